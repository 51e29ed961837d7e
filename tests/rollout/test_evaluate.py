"""`ppo-eval`: greedy responses scored into an accuracy (with its Wilson interval) and written one
jsonl row per prompt; the model forms ppo-eval accepts."""

from __future__ import annotations

import functools
import os
import json

import pytest

from ppo_trainer.batch import Batch
from ppo_trainer.data.datasets import PromptRecord
from ppo_trainer.config import ConfigError
from ppo_trainer.evaluate import evaluate_records, format_results, run_eval, wilson_interval
from ppo_trainer.rewards import math as math_reward
from ppo_trainer.rollout.base import assemble_rollout, prompt_token_lists

REWARD = functools.partial(math_reward.score, mode="strict", format_score=0.1)


class ScriptedSampler:
    """Answers prompt i with texts[i]; records how it was called."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.calls: list[tuple[int, bool]] = []

    def generate(self, batch: Batch, n: int = 1, *, seed: int = 0, greedy: bool = True) -> Batch:
        self.calls.append((len(batch), greedy))
        texts = [self.texts[i] for i in batch.prompt_index]
        ids = [[7] * (i % 3 + 1) for i in range(len(batch))]
        return assemble_rollout(batch, n, ids, [[-0.5] * len(r) for r in ids],
                                [i == 2 for i in batch.prompt_index], texts, pad_id=0)

    def sync_weights(self, state_dict) -> None: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(i, f"question {i}", f"prompt {i}", (1, 2, 3 + i), str(i * 10)) for i in range(n)]


def test_evaluate_records_scores_greedy_responses_and_writes_one_row_per_prompt(tmp_path):
    texts = ["so #### 0", "#### 11", "ten is it: 20", "#### 30.0"]
    sampler = ScriptedSampler(texts)
    out = tmp_path / "eval" / "eval.jsonl"
    result = evaluate_records(sampler.generate, records(4), REWARD, pad_id=0, batch_size=3, output_file=out)

    assert sampler.calls == [(3, True), (1, True)]  # batches of eval.batch_size
    assert result["accuracy"] == 0.5 and result["num_examples"] == 4 and result["num_correct"] == 2
    assert result["mean_score"] == pytest.approx((1 + 0.1 + 0 + 1) / 4)
    assert result["truncated_fraction"] == 0.25
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[1] == {"index": 1, "question": "question 1", "response": "#### 11", "extracted": "11",
                       "ground_truth": "10", "score": 0.1, "correct": False, "truncated": False}
    assert rows[2]["extracted"] is None and rows[2]["truncated"] is True
    assert rows[3]["correct"] is True


def test_evaluate_records_takes_the_first_limit_records():
    sampler = ScriptedSampler(["#### 0", "#### 10", "#### 20"])
    result = evaluate_records(sampler.generate, records(3), REWARD, pad_id=0, limit=2)
    assert result["num_examples"] == 2 and result["accuracy"] == 1.0


def test_run_eval_with_the_hf_sampler_reads_the_validation_split_within_limit_and_max_new_tokens(tiny_model_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    import ppo_trainer.rollout.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "check_vllm_available", lambda: "vLLM is not installed")  # the HF path
    (result,) = run_eval([f"model.path={tiny_model_dir}", "model.dtype=float32", "eval.limit=3",
                          "eval.max_new_tokens=4", f"trainer.output_dir={tmp_path}"])
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


def test_several_results_print_as_one_table():
    rows = [{"model": "base", "step": None, "accuracy": 0.25, "num_correct": 1, "num_examples": 4, "mean_score": 0.3,
             "output_file": "eval.0.jsonl"},
            {"model": "run/checkpoints/best", "step": 5, "accuracy": 0.5, "num_correct": 2, "num_examples": 4,
             "mean_score": 0.55, "output_file": "eval.1.jsonl"}]
    lines = format_results(rows, "strict").splitlines()
    assert lines[0] == "ppo-eval: 2 models on the same problems (reward.mode=strict)"
    assert lines[1].split()[:3] == ["model", "accuracy", "95%"]
    low, high = wilson_interval(2, 4)
    assert lines[3].split() == ["run/checkpoints/best", "(step", "5)", "0.5000", f"{low:.3f}-{high:.3f}", "4",
                                "0.5500", "eval.1.jsonl"]
    assert len({line.index("accuracy") if i == 1 else None for i, line in enumerate(lines)}) == 2


def test_a_run_folder_without_checkpoints_is_an_input_error(tmp_path, capsys):
    from ppo_trainer.cli import eval_main

    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        eval_main([f"model.path={tmp_path}"])
    assert exit_info.value.code == 2
    assert "holds no checkpoint yet" in capsys.readouterr().err


def test_experiment_with_a_checkpoint_is_a_config_error(tmp_path):
    from ppo_trainer.evaluate import eval_config

    (tmp_path / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ConfigError, match=r"\+experiment"):
        eval_config(None, ["+experiment=smoke"], tmp_path / "config.yaml")


def test_scripted_sampler_sees_unpadded_prompts():
    """Guards the fake above: evaluate_records passes the records' own token ids."""
    sampler = ScriptedSampler(["#### 0", "#### 10"])
    seen: list[list[int]] = []
    original = sampler.generate

    def spy(batch, n=1, **kw):
        seen.extend(prompt_token_lists(batch))
        return original(batch, n, **kw)

    sampler.generate = spy
    evaluate_records(sampler.generate, records(2), REWARD, pad_id=0)
    assert seen == [[1, 2, 3], [1, 2, 4]]


def test_run_eval_sends_the_engines_output_to_engine_log(tiny_model_dir, tmp_path, monkeypatch, capfd):
    import ppo_trainer.evaluate as evaluate_module
    import ppo_trainer.rollout.vllm as vllm_module

    def chatty_sampler(*args, **kwargs):  # an engine that writes to the process's descriptors, as vLLM does
        os.write(2, b"engine warning on fd 2\n")
        return ScriptedSampler(["#### 0"] * 3)

    monkeypatch.setattr(vllm_module, "check_vllm_available", lambda: "vLLM is not installed")
    monkeypatch.setattr(evaluate_module, "build_sampler", chatty_sampler)
    run_eval([f"model.path={tiny_model_dir}", "model.dtype=float32", "eval.limit=3", f"trainer.output_dir={tmp_path}"])
    console = capfd.readouterr()
    assert "engine warning" not in console.out + console.err
    assert "ppo-eval: accuracy" in console.out
    assert "engine warning on fd 2" in (tmp_path / "engine.log").read_text()
