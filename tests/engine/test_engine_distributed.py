"""2 processes (gloo, FSDP2) == 1 process on the same global batch; resume; full-state gather.

One spawn for the whole module: `dist_worker.py` runs every scenario on 2 ranks and rank 0 saves
the results; the tests here compare them with the same routines run in this process (1 rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_cases import (
    BIG_BUDGET,
    PROMPT_LENS,
    RESPONSE_LENS,
    make_actor,
    make_critic,
    naive_logprobs,
    one_step,
    random_batch,
)

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    """Two random batches, and the first with returns a random value head reads off the states (a
    target the value head's fit can find)."""
    from ppo_trainer.models.critic import ValueModel

    first = random_batch(PROMPT_LENS, RESPONSE_LENS, seed=0)
    teacher = ValueModel.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        teacher.value_head.weight.copy_(torch.randn(teacher.value_head.weight.shape,
                                                    generator=torch.Generator().manual_seed(7)))
        returns = teacher(first.input_ids, first.attention_mask, first.position_ids, first.response_mask)
    return {"first": first, "second": random_batch(PROMPT_LENS, RESPONSE_LENS, seed=1),
            "fit": first.with_fields(returns=returns)}


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, batches, tmp_path_factory) -> Path:
    """Run the worker on 2 ranks; returns its output folder. Fails with the first rank's error."""
    out = tmp_path_factory.mktemp("two-ranks")
    torch.save(batches, out / "batches.pt")
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        command = [sys.executable, str(WORKER), str(tiny_model_dir), str(out / "batches.pt"), str(out)]
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    failed = []
    for rank, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            code = "timeout"
        if code != 0:
            failed.append((rank, code))
    for log in logs:
        log.close()
    if failed:
        # The rank that failed first names the real error; its peer only sees the connection close.
        texts = {r: (out / f"rank{r}.log").read_text()[-4000:] for r, _ in failed}
        first = next((r for r in texts if "Connection closed" not in texts[r]), failed[0][0])
        pytest.fail(f"rank {first} failed ({dict(failed)}):\n{texts[first]}")
    return out


def test_two_ranks_saw_unequal_tokens_and_micro_batch_counts(two_ranks):
    layouts = torch.load(two_ranks / "actor_step.pt", weights_only=False)["layouts"]  # [rank, (tokens, micro)]
    assert layouts[0, 0] != layouts[1, 0]
    assert layouts[0, 1] != layouts[1, 1]


def test_two_rank_actor_step_equals_one_process_step(two_ranks, tiny_model_dir, batches):
    dist = torch.load(two_ranks / "actor_step.pt", weights_only=False)
    grads, state, stats = one_step(make_actor(tiny_model_dir, budget=BIG_BUDGET), batches["first"], BIG_BUDGET)
    assert dist["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(dist["grads"][name], g, atol=1e-6, rtol=0)
    moved = 0.0
    initial = make_actor(tiny_model_dir).full_state_dict()
    for name, w in state.items():
        torch.testing.assert_close(dist["state"][name], w, atol=1e-5, rtol=0)
        moved = max(moved, (w - initial[name]).abs().max().item())
    assert moved > 5e-5  # the step moved the weights by more than the tolerance
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm"):
        assert dist["stats"][key] == pytest.approx(stats[key], abs=1e-6)


def test_two_rank_critic_step_equals_one_process_step(two_ranks, tiny_model_dir, batches):
    dist = torch.load(two_ranks / "critic_step.pt", weights_only=False)
    critic = make_critic(tiny_model_dir, budget=BIG_BUDGET)
    critic.update(batches["first"])
    grads, state, stats = one_step(critic, batches["second"], BIG_BUDGET)
    for name, g in grads.items():
        torch.testing.assert_close(dist["grads"][name], g, atol=1e-6, rtol=0)
    for name, w in state.items():
        torch.testing.assert_close(dist["state"][name], w, atol=1e-5, rtol=0)
    assert dist["stats"]["vf_loss"] == pytest.approx(stats["vf_loss"], abs=1e-6)


def test_two_ranks_fit_the_value_head_as_one_process_does(two_ranks, tiny_model_dir, batches):
    """Each rank forwards its share; the summed statistics give every rank the one-process fit."""
    dist = torch.load(two_ranks / "critic_fit.pt", weights_only=False)
    critic = make_critic(tiny_model_dir)
    metrics = critic.fit_value_head(batches["fit"])
    assert metrics["critic/value_head_fit/cv_explained_var"] > 0.5  # held-out prompts: the teacher's head is found
    assert dist["metrics"]["critic/value_head_fit/ridge"] == metrics["critic/value_head_fit/ridge"]
    assert dist["metrics"]["critic/value_head_fit/cv_explained_var"] == pytest.approx(
        metrics["critic/value_head_fit/cv_explained_var"], abs=1e-6)
    head = {k: v for k, v in critic.full_state_dict().items() if k.startswith("value_head.")}
    for name, w in head.items():
        torch.testing.assert_close(dist["head"][name], w, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dist["values"], critic.compute_values(batches["first"]), atol=1e-5, rtol=0)


def test_two_rank_save_reload_and_continue_equals_not_stopping(two_ranks):
    dist = torch.load(two_ranks / "actor_resume.pt", weights_only=False)
    assert dist["resumed_metrics"] == dist["continued_metrics"]
    assert dist["resumed"].keys() == dist["continued"].keys()
    for name, w in dist["continued"].items():
        assert torch.equal(dist["resumed"][name], w), name


def test_full_state_dict_from_two_ranks_loads_into_plain_transformers(two_ranks, tiny_model_dir, batches):
    from transformers import AutoModelForCausalLM

    dist = torch.load(two_ranks / "actor_step.pt", weights_only=False)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(dist["state"])  # strict: exactly the transformers names
    torch.testing.assert_close(naive_logprobs(plain, batches["first"], 0.7), dist["logprobs"], atol=1e-5, rtol=0)

    exported = AutoModelForCausalLM.from_pretrained(two_ranks / "actor_hf", dtype=torch.float32).eval()
    for name, w in exported.state_dict().items():
        assert torch.equal(w, dist["state"][name]), name
    assert (two_ranks / "actor_hf" / "tokenizer.json").is_file()
