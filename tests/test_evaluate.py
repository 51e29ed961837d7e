"""`ppo-eval` and validation: responses scored into an accuracy (with its Wilson interval), per
data_source, mean@n and pass@n with several samples, written one jsonl row per response; the
model forms ppo-eval accepts."""

from __future__ import annotations

import functools
import json
import os

import pytest

from ppo_trainer.batch import Batch
from ppo_trainer.cli import run_eval
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.data.datasets import PromptRecord
from ppo_trainer.evaluate import (
    eval_temperature,
    evaluate_records,
    first_per_source,
    format_results,
    validation_metrics,
    validation_seed,
    wilson_interval,
)
from ppo_trainer.rewards import math as math_reward
from ppo_trainer.rewards.calling import Calling
from ppo_trainer.rewards.scoring import Accuracy, FunctionScorer
from ppo_trainer.rollout.base import assemble_rollout, prompt_token_lists

REWARD = FunctionScorer(functools.partial(math_reward.score, mode="strict", format_score=0.1), Calling("pair"))


class ScriptedSampler:
    """Answers the k-th prompt it is given with texts[k] (sample j of it with texts[k][j] when that
    is a list): evaluate_records gives the records in their order, so prompt k is record k of a
    prefix of them; the third prompt's responses are truncated. Records how it was called as
    (prompts, n, seed, greedy, temperature)."""

    def __init__(self, texts: list[str | list[str]]):
        self.texts = texts
        self.given = 0  # prompts answered so far
        self.calls: list[tuple[int, int, int, bool, float | None]] = []

    def generate(self, batch: Batch, n: int = 1, seed: int = 0, greedy: bool = False,
                 max_new_tokens: int | None = None, temperature: float | None = None) -> Batch:
        self.calls.append((len(batch), n, seed, greedy, temperature))
        order = range(self.given, self.given + len(batch))
        self.given += len(batch)
        scripts = [self.texts[k] for k in order]
        texts = [s[j] if isinstance(s, list) else s for s in scripts for j in range(n)]
        ids = [[7] * (r % 3 + 1) for r in range(len(batch) * n)]
        truncated = [k == 2 for k in order for _ in range(n)]
        return assemble_rollout(batch, n, ids, [[-0.5] * len(r) for r in ids], truncated, texts, pad_id=0)

    def greedy(self, batch: Batch, seed: int) -> Batch:
        """What validation and ppo-eval pass to evaluate_records for eval.n=1 greedy."""
        return self.generate(batch, 1, seed=seed, greedy=True)

    def sleep(self) -> None: ...
    def wake(self) -> None: ...


def records(n: int, sources: tuple[str, ...] = ("src",)) -> list[PromptRecord]:
    """Prompt i of data_source sources[i % len(sources)], ground truth str(10 i)."""
    return [PromptRecord(i, f"question {i}", f"prompt {i}", (1, 2, 3 + i), str(i * 10), sources[i % len(sources)],
                         {"i": i}) for i in range(n)]


def test_evaluate_records_scores_greedy_responses_and_writes_one_row_per_prompt(tmp_path):
    texts = ["so #### 0", "#### 11", "ten is it: 20", "#### 30.0"]
    sampler = ScriptedSampler(texts)
    out = tmp_path / "eval" / "eval.jsonl"
    result = evaluate_records(sampler.greedy, records(4), REWARD, pad_id=0, seed=11, batch_size=3, output_file=out)

    assert sampler.calls == [(3, 1, 11, True, None), (1, 1, 12, True, None)]  # eval.batch_size prompts, seed + call
    assert result["accuracy"] == 0.5 and result["num_examples"] == 4 and result["num_correct"] == 2
    assert result["mean_score"] == pytest.approx((1 + 0.1 + 0 + 1) / 4)
    assert result["truncated_fraction"] == 0.25
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[1] == {"data_source": "src", "index": 1, "sample": 0, "question": "question 1", "prompt": "prompt 1",
                       "response": "#### 11", "extracted": "11", "ground_truth": "10", "extra_info": {"i": 1},
                       "score": 0.1, "extras": {}, "correct": False, "truncated": False}
    assert rows[2]["extracted"] is None and rows[2]["truncated"] is True
    assert rows[3]["correct"] is True


def test_evaluate_records_takes_the_first_limit_records():
    sampler = ScriptedSampler(["#### 0", "#### 10", "#### 20"])
    result = evaluate_records(sampler.greedy, records(3), REWARD, pad_id=0, limit=2)
    assert result["num_examples"] == 2 and result["accuracy"] == 1.0


# Hand count. Truths "0", "10", "20", "30"; sources A (prompts 0, 2) and openai/gsm8k (1, 3); 3 samples:
#   prompt 0 (A):            #### 0 (1), #### 1 (0.1), #### 0 (1)        2 correct
#   prompt 1 (openai/gsm8k): #### 5 (0.1), none (0), #### 5 (0.1)        0 correct
#   prompt 2 (A):            none (0), none (0), none (0)                0 correct
#   prompt 3 (openai/gsm8k): #### 30 x 3 (1 each)                        3 correct
# A: mean@3 2/6, pass@3 1/2, score (1 + 0.1 + 1) / 6; openai/gsm8k: mean@3 3/6, pass@3 1/2,
# score (0.1 + 0 + 0.1 + 3) / 6; pooled: mean@3 5/12, pass@3 2/4, score 5.3/12.
SAMPLED = [["#### 0", "#### 1", "#### 0"], ["#### 5", "none", "#### 5"], ["none"] * 3, ["#### 30"] * 3]


def test_sampled_validation_metrics_per_source_match_a_hand_count(tmp_path):
    sampler = ScriptedSampler(SAMPLED)
    out = tmp_path / "val_generations" / "step_3.jsonl"
    result = evaluate_records(lambda batch, seed: sampler.generate(batch, 3, seed=seed, temperature=0.7),
                              records(4, ("A", "openai/gsm8k")), REWARD, pad_id=0, n=3, seed=5, batch_size=4,
                              output_file=out)
    assert sampler.calls == [(4, 3, 5, False, 0.7)]
    expected = {
        "val/accuracy": 5 / 12, "val/score/mean": 5.3 / 12, "val/accuracy/mean@3": 5 / 12, "val/accuracy/pass@3": 0.5,
        "val/A/accuracy": 2 / 6, "val/A/score/mean": 2.1 / 6, "val/A/accuracy/mean@3": 2 / 6,
        "val/A/accuracy/pass@3": 0.5,
        "val/openai/gsm8k/accuracy": 3 / 6, "val/openai/gsm8k/score/mean": 3.2 / 6,
        "val/openai/gsm8k/accuracy/mean@3": 3 / 6, "val/openai/gsm8k/accuracy/pass@3": 0.5,
    }
    metrics = validation_metrics(result)
    assert metrics.keys() == expected.keys()
    assert metrics == pytest.approx(expected)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"], r["data_source"]) for r in rows[:4]] == [(0, 0, "A"), (0, 1, "A"), (0, 2, "A"),
                                                                               (1, 0, "openai/gsm8k")]
    assert [r["score"] for r in rows[:3]] == [1.0, 0.1, 1.0]


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    """Half a point for the format, never the correct_score threshold of 1; "acc" says who is right."""
    return {"score": 0.5 if "####" in solution_str else 0.0, "acc": solution_str == f"#### {ground_truth}"}


VERL_STYLE = FunctionScorer(verl_style, Calling("row", ("data_source", "solution_str", "ground_truth", "extra_info")))


def test_validation_accuracy_comes_from_the_functions_acc_when_it_returns_one(tmp_path):
    # SAMPLED's hand count holds for acc; the scores (0.5 for each of the 8 responses with "####")
    # never reach the threshold, which would give accuracy 0
    sampler = ScriptedSampler(SAMPLED)
    out = tmp_path / "step_0.jsonl"
    result = evaluate_records(lambda batch, seed: sampler.generate(batch, 3, seed=seed, temperature=0.7),
                              records(4, ("A", "openai/gsm8k")), VERL_STYLE, pad_id=0, n=3, batch_size=4,
                              output_file=out)
    metrics = validation_metrics(result)
    assert metrics["val/accuracy"] == pytest.approx(5 / 12) and metrics["val/accuracy/pass@3"] == 0.5
    assert metrics["val/A/accuracy"] == pytest.approx(2 / 6) and metrics["val/score/mean"] == pytest.approx(4 / 12)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["score"], r["extras"], r["correct"]) for r in rows[:2]] == [(0.5, {"acc": 1.0}, 1.0),
                                                                          (0.5, {"acc": 0.0}, 0.0)]


def test_a_fractional_acc_averages_in_mean_at_n_and_pass_at_n_takes_the_best():
    sampler = ScriptedSampler([["a", "b"], ["c", "d"]])
    acc = {"a": 0.5, "b": 0.0, "c": 1.0, "d": 0.25}
    scorer = FunctionScorer(lambda response, ground_truth: {"score": 0.0, "acc": acc[response]}, Calling("pair"))
    result = evaluate_records(lambda batch, seed: sampler.generate(batch, 2, seed=seed), records(2), scorer, pad_id=0, n=2)
    assert result["accuracy"] == pytest.approx(1.75 / 4) and result["pass_at_n"] == pytest.approx((0.5 + 1.0) / 2)


def test_correct_score_given_for_a_function_returning_acc_is_a_config_error():
    scorer = FunctionScorer(verl_style, VERL_STYLE.calling, accuracy=Accuracy(0.5, threshold_only=True))
    with pytest.raises(ConfigError, match=r"'reward.correct_score' is 0.5, but reward.fn returns 'acc', which decides "
                                          r"validation accuracy, .*remove reward.correct_score"):
        evaluate_records(ScriptedSampler(["#### 0"]).greedy, records(1), scorer, pad_id=0)
    threshold = FunctionScorer(REWARD.fn, Calling("pair"), accuracy=Accuracy(0.1, threshold_only=True))
    result = evaluate_records(ScriptedSampler(["#### 7"]).greedy, records(1), threshold, pad_id=0)
    assert result["accuracy"] == 1.0  # no acc: the given correct_score is the threshold (format score 0.1 >= 0.1)


def test_greedy_validation_of_two_sources_pools_over_rows_and_has_no_pass_at_n():
    sampler = ScriptedSampler(["#### 0", "#### 10", "#### 20", "no"])
    metrics = validation_metrics(evaluate_records(sampler.greedy, records(4, ("A", "B")), REWARD, pad_id=0))
    assert metrics == pytest.approx({"val/accuracy": 0.75, "val/score/mean": 0.75, "val/A/accuracy": 1.0,
                                     "val/A/score/mean": 1.0, "val/B/accuracy": 0.5, "val/B/score/mean": 0.5})


def test_eval_limit_applies_per_source():
    sampler = ScriptedSampler(["#### 0"] * 7)
    result = evaluate_records(sampler.greedy, records(7, ("A", "B")), REWARD, pad_id=0, limit=2)
    assert {name: part["num_examples"] for name, part in result["sources"].items()} == {"A": 2, "B": 2}
    assert [r.index for r in first_per_source(records(7, ("A", "B")), 2)] == [0, 1, 2, 3]


@pytest.mark.parametrize(("temperature", "n", "expected"), [(None, 1, None), (None, 4, 0.7), (0.0, 1, None),
                                                             (1.2, 1, 1.2), (1.2, 4, 1.2)])
def test_eval_temperature_null_is_greedy_for_one_sample_and_the_samplers_for_more(temperature, n, expected):
    assert eval_temperature(temperature, n, sampler_temperature=0.7) == expected


def test_validation_seed_depends_on_seed_and_step_only():
    assert validation_seed(0, 5) == validation_seed(0, 5)
    assert len({validation_seed(seed, step) for seed in range(3) for step in range(50)}) == 150


def test_run_eval_with_the_hf_sampler_reads_the_validation_split_within_limit_and_max_new_tokens(tiny_model_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    import ppo_trainer.rollout.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "check_vllm_available", lambda: "vLLM is not installed")  # the HF path
    (result,) = run_eval([f"model.path={tiny_model_dir}", "model.dtype=float32", "eval.limit=3",
                          "eval.max_new_tokens=4", f"eval.output_file={tmp_path / 'eval.jsonl'}"])
    assert result["num_examples"] == 3 and result["step"] is None
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and result["accuracy"] == 0.0  # a random model does not answer "#### N"
    assert all(len(r["response"]) <= 4 for r in rows)  # eval.max_new_tokens, one character per token
    assert "ppo-eval: accuracy 0.0000 (95% CI 0.000-0.561) on 3 problems" in capsys.readouterr().out


def test_wilson_interval_matches_hand_computed_values():
    # 0 of 10: [0, z^2 / (n + z^2)]; 5 of 10: 0.5 -+ z * sqrt(0.25 n + z^2 / 4) / (n + z^2)
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)), abs=1e-12)
    half = 1.959963984540054 * (2.5 + z2 / 4) ** 0.5 / (10 + z2)
    assert wilson_interval(5, 10) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # the textbook figures
    assert wilson_interval(10, 10) == pytest.approx((1 - z2 / (10 + z2), 1.0), abs=1e-12)  # mirrors 0 of 10
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def _result(model: str, step, accuracy: float, correct: int, score: float, output: str, n: int = 1,
            sources: tuple[str, ...] = ("src",), temperature=None) -> dict:
    part = {"accuracy": accuracy, "num_correct": correct, "num_examples": 4, "mean_score": score, "pass_at_n": 0.75}
    return {"model": model, "step": step, **part, "n": n, "temperature": temperature,
            "sources": {name: part for name in sources}, "output_file": output}


def test_several_results_print_as_one_table():
    rows = [_result("base", None, 0.25, 1, 0.3, "eval.0.jsonl"),
            _result("run/checkpoints/best", 5, 0.5, 2, 0.55, "eval.1.jsonl")]
    lines = format_results(rows, "strict").splitlines()
    assert lines[0] == "ppo-eval: 2 models on the same problems, greedy (reward.mode=strict)"
    assert lines[1].split()[:4] == ["model", "data_source", "problems", "accuracy"]
    low, high = wilson_interval(2, 4)
    assert lines[3].split() == ["run/checkpoints/best", "(step", "5)", "src", "4", "0.5000", f"{low:.3f}-{high:.3f}",
                                "0.5500", "eval.1.jsonl"]
    assert len({line.index("accuracy") if i == 1 else None for i, line in enumerate(lines)}) == 2


def test_sampled_results_print_mean_and_pass_at_n_per_source_and_pooled():
    lines = format_results([_result("run", 5, 0.5, 8, 0.6, "eval.jsonl", n=4, sources=("a", "openai/gsm8k"),
                                    temperature=0.7)], "strict").splitlines()
    assert lines[0] == "ppo-eval: 1 model, 4 samples per prompt at temperature 0.7 (reward.mode=strict)"
    assert lines[1].split() == ["model", "data_source", "problems", "mean@4", "pass@4", "mean", "score", "responses"]
    assert [line.split()[3] for line in lines[2:]] == ["a", "openai/gsm8k", "(all)"]
    assert lines[3].split()[4:7] == ["4", "0.5000", "0.7500"]


def test_a_run_folder_without_checkpoints_is_an_input_error(tmp_path, capsys):
    from ppo_trainer.cli import eval_main

    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        eval_main([f"model.path={tmp_path}"])
    assert exit_info.value.code == 2
    assert "holds no checkpoint yet" in capsys.readouterr().err


def test_experiment_with_a_checkpoint_is_a_config_error(tmp_path):
    from ppo_trainer.config.trust import eval_config

    (tmp_path / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ConfigError, match=r"\+experiment"):
        eval_config(None, ["+experiment=smoke"], tmp_path / "config.yaml")


def test_scripted_sampler_sees_unpadded_prompts():
    """Guards the fake above: evaluate_records passes the records' own token ids."""
    sampler = ScriptedSampler(["#### 0", "#### 10"])
    seen: list[list[int]] = []

    def spy(batch, seed):
        seen.extend(prompt_token_lists(batch))
        return sampler.greedy(batch, seed)

    evaluate_records(spy, records(2), REWARD, pad_id=0)
    assert seen == [[1, 2, 3], [1, 2, 4]]


def test_run_eval_sends_the_engines_output_to_engine_log(tiny_model_dir, tmp_path, monkeypatch, capfd):
    import ppo_trainer.rollout as rollout_module
    import ppo_trainer.rollout.vllm as vllm_module

    def chatty_sampler(*args, **kwargs):  # an engine that writes to the process's descriptors, as vLLM does
        os.write(2, b"engine warning on fd 2\n")
        return ScriptedSampler(["#### 0"] * 3)

    monkeypatch.setattr(vllm_module, "check_vllm_available", lambda: "vLLM is not installed")
    monkeypatch.setattr(rollout_module, "build_sampler", chatty_sampler)
    run_eval([f"model.path={tiny_model_dir}", "model.dtype=float32", "eval.limit=3",
              f"eval.output_file={tmp_path / 'eval.jsonl'}"])
    console = capfd.readouterr()
    assert "engine warning" not in console.out + console.err
    assert "ppo-eval: accuracy" in console.out
    assert "engine warning on fd 2" in (tmp_path / "engine.log").read_text()
