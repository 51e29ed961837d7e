"""Partial rollouts (`rollout.vllm_partial`): a weight push pauses a generation in flight, which then
continues under the new weights, and each token keeps the logprob and the policy version of the weights
that sampled it.

The proof is an HF recompute under each weight set (fp32, < 1e-3 as in test_weight_sync.py): tokens
labelled with the old version match the old weights and not the new, tokens labelled with the new
version the new weights and not the old. One `AsyncLLM` engine (its core in processes of its own, ~20 s
to start) serves the module; each test pushes the weights it needs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.rollout.base import RowSampling
from ppo_trainer.rollout.vllm_partial import span_versions

from .conftest import load_model, reference_logprobs, sampler_config

MATCH = 1e-3  # fp32 engine vs fp32 HF forward, as in test_weight_sync.py
STALE = 1e-2  # the other weight set is off by far more than this
LONG = 64  # tokens per sample, every sample running until then (ignore_eos): the push lands mid-way


def span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)  # vllm.outputs.WeightVersionSpan's fields


def test_spans_give_each_token_its_version():
    assert span_versions([span("3", 0, 2), span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert span_versions([], 0) == []


@pytest.mark.parametrize("spans, length", [
    ([span("3", 0, 2)], 3),  # the last token has no version
    ([span("3", 0, 2), span("4", 3, 5)], 5),  # a gap
    (None, 2),  # vLLM reported no version at all
])
def test_spans_that_miss_a_token_are_refused(spans, length):
    with pytest.raises(ValueError, match="do not cover the sample's"):
        span_versions(spans, length)


def test_partial_rollouts_build_the_async_engine_where_the_plain_one_would_be(monkeypatch):
    import ppo_trainer.rollout as rollout

    built = []

    class Engine:
        def __init__(self, model_dir, cfg, **kwargs):
            built.append((type(self).__name__, kwargs))
            self.llm, self.pad_id, self.eos_ids = self, 0, [0]

        def get_tokenizer(self):
            return "tokenizer"

    monkeypatch.setattr(rollout, "VllmSampler", type("Plain", (Engine,), {}))
    monkeypatch.setattr(rollout, "PartialVllmSampler", type("Partial", (Engine,), {}))
    cfg = sampler_config(name="vllm", max_new_tokens=10)
    rollout.build_sampler(cfg, "model", max_prompt_length=50, colocate=True)
    rollout.build_sampler(dataclasses.replace(cfg, partial_rollouts=True), "model", max_prompt_length=50)
    common = {"dtype": "bfloat16", "seed": 0, "max_model_len": 60, "trust_remote_code": False}
    assert built == [("Plain", {**common, "enable_sleep": True}), ("Partial", common)]  # never asleep: k >= 1


@pytest.fixture(scope="module")
def partial_sampler(tiny_model_dir, tmp_path_factory):
    """One float32 `PartialVllmSampler` on the tiny model for the module (skips without vLLM); its
    engine's own sockets on the loopback interface."""
    from ppo_trainer.rollout import check_vllm_available

    if problem := check_vllm_available():
        pytest.skip(problem)
    from ppo_trainer.rollout.vllm_partial import PartialVllmSampler

    saved = os.environ.get("VLLM_HOST_IP")
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    try:
        sampler = PartialVllmSampler(tiny_model_dir, sampler_config(), dtype="float32", seed=0)
        yield sampler
        engine, sampler.llm = sampler.llm, None
        engine.shutdown()  # its processes; dropped now, its __del__ runs while the modules it uses exist
        del engine
    finally:
        if saved is None:
            os.environ.pop("VLLM_HOST_IP", None)
        else:
            os.environ["VLLM_HOST_IP"] = saved


def push(sampler, state: dict[str, torch.Tensor], version: int) -> None:
    """A weight push as the trainer makes it: buckets, the label, the end of the sync."""
    sampler.load_weight_bucket(state)
    sampler.set_policy_version(version)
    sampler.finish_weight_sync()


def moved(model) -> dict[str, torch.Tensor]:
    """`model`'s weights with fixed noise added: another policy (seeded, the same in every run)."""
    generator = torch.Generator().manual_seed(0)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def tokens_so_far(sampler) -> list[int]:
    """Output tokens of each request the engine is running (vLLM's output processor: a test's look
    inside, to push only once every sample has started)."""
    return [state.detokenizer.num_output_tokens() for state in sampler.llm.output_processor.request_states.values()]


def gap(model, rollout: Batch, where: torch.Tensor) -> float:
    """Largest |sampler logprob - `model`'s recomputed logprob| over the tokens `where` ([B, T] bool)."""
    return (reference_logprobs(model, rollout, 1.0) - rollout.sample_logprobs).abs()[where].max().item()


def test_a_push_mid_generation_continues_each_sample_under_the_new_weights_with_their_logprobs(
        partial_sampler, tiny_model_dir, prompts):
    old = load_model(tiny_model_dir).eval()
    new = load_model(tiny_model_dir).eval()
    new.load_state_dict(moved(new))
    push(partial_sampler, old.state_dict(), 3)
    partial_sampler.cfg = sampler_config(max_new_tokens=LONG, ignore_eos=True)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the rollout worker's generate thread
        running = pool.submit(partial_sampler.generate, prompts, 2, 11)
        deadline = time.monotonic() + 120
        while len(tokens_so_far(partial_sampler)) < len(prompts) * 2 or min(tokens_so_far(partial_sampler)) < 4:
            assert not running.done() and time.monotonic() < deadline, "the generation never got going"
            time.sleep(0.01)
        push(partial_sampler, new.state_dict(), 4)  # the push thread, while the generation runs
        rollout = running.result()

    real = rollout.response_mask.bool()
    assert real.sum(dim=1).tolist() == [LONG] * 6
    versions = rollout.token_version
    assert set(versions[real].tolist()) == {3, 4}
    cut = (versions == 3).sum(dim=1)  # each row: version 3 up to its cut, 4 after it
    assert (cut >= 4).all() and (cut < LONG).all(), f"every sample is cut mid-way, at {cut.tolist()}"
    assert torch.equal(versions[real].view(6, LONG), (torch.arange(LONG) >= cut.unsqueeze(1)) * 1 + 3)
    before, after = real & (versions == 3), real & (versions == 4)
    assert gap(old, rollout, before) < MATCH and gap(new, rollout, after) < MATCH
    assert gap(new, rollout, before) > STALE and gap(old, rollout, after) > STALE


def test_without_a_push_every_token_carries_the_version_the_weights_were_labelled(partial_sampler, tiny_model_dir,
                                                                                   prompts):
    model = load_model(tiny_model_dir).eval()
    push(partial_sampler, model.state_dict(), 7)
    partial_sampler.cfg = sampler_config()
    rollout = partial_sampler.generate(prompts, 2, 5)
    real = rollout.response_mask.bool()
    assert (rollout.token_version[real] == 7).all() and (rollout.token_version[~real] == 0).all()
    assert gap(model, rollout, real) < MATCH
    (turn,) = partial_sampler.complete([prompts.input_ids[1][prompts.attention_mask[1].bool()].tolist()], [3],
                                       [RowSampling(max_new_tokens=5)])
    assert turn.versions == [7] * len(turn.token_ids) and len(turn.token_ids) >= 1
