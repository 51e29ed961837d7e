"""Both samplers return the same rollout layout: shapes, masks, EOS and stop handling, seeding."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.rollout import HFSampler, prompts_to_batch
from ppo_trainer.rollout.base import RowSampling, prompt_token_lists

from .conftest import MAX_NEW_TOKENS, load_model, reference_logprobs, sampler_config, with_leaky_generation_config


@pytest.fixture(scope="module")
def hf_eos_sampler(eos_model_dir):
    return HFSampler(eos_model_dir, sampler_config(), batch_size=5)


@pytest.fixture(params=["hf", "vllm"])
def sampler(request, hf_eos_sampler, eos_state):
    """Either sampler, generating with the EOS-prone weights and the default test settings."""
    if request.param == "hf":
        hf_eos_sampler.cfg = sampler_config()
        yield hf_eos_sampler
        hf_eos_sampler.cfg = sampler_config()
    else:
        engine = request.getfixturevalue("vllm_sampler")
        engine.load_weight_bucket(eos_state)
        engine.finish_weight_sync()
        yield engine


def assert_rollout_layout(out: Batch, prompts: Batch, n: int, eos_id: int, pad_id: int) -> None:
    """Every structural promise of the rollout Batch, row by row."""
    B, P, T = len(prompts) * n, prompts.input_ids.shape[1], out.response_length
    assert len(out) == B and out.prompt_length == P and 1 <= T <= MAX_NEW_TOKENS
    assert out.input_ids.shape == out.attention_mask.shape == out.position_ids.shape == (B, P + T)
    assert out.response_mask.shape == out.sample_logprobs.shape == (B, T)
    assert out.truncated.shape == (B,) and out.truncated.dtype == torch.bool
    source = torch.arange(len(prompts)).repeat_interleave(n)
    assert torch.equal(out.input_ids[:, :P], prompts.input_ids[source])
    assert torch.equal(out.attention_mask, torch.cat([prompts.attention_mask[source], out.response_mask], dim=1))
    assert out.prompt_text == [prompts.prompt_text[i] for i in source.tolist()]
    assert out.ground_truth == [prompts.ground_truth[i] for i in source.tolist()]
    assert len(out.response_text) == B

    for r in range(B):
        length = int(out.response_mask[r].sum())
        assert out.response_mask[r, :length].all() and not out.response_mask[r, length:].any()  # a prefix
        ids = out.response_ids[r]
        assert (ids[length:] == pad_id).all()
        assert not (ids[: max(length - 1, 0)] == eos_id).any(), "EOS inside a response"
        if out.truncated[r]:
            assert length == MAX_NEW_TOKENS and ids[length - 1] != eos_id
        else:
            assert length >= 1 and ids[length - 1] == eos_id  # EOS is the last real token
        lp = out.sample_logprobs[r]
        assert (lp[:length] <= 0).all() and (lp[:length] > -30).all() and (lp[length:] == 0).all()
        real = out.attention_mask[r].bool()
        assert out.position_ids[r][real].tolist() == list(range(int(real.sum())))


@pytest.mark.parametrize("n", [1, 4])
def test_rollout_layout_masks_and_eos(sampler, prompts, tokenizer, n):
    out = sampler.generate(prompts, n, seed=3)
    assert_rollout_layout(out, prompts, n, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if n == 4:  # the EOS-prone model yields both kinds of ending
        assert out.truncated.any() and (~out.truncated).any()


def test_stop_string_ends_the_response_at_its_last_token_and_is_cut_from_the_text(sampler, prompts, tokenizer):
    stops = ["1", "a", "e", "o", "#"]
    sampler.cfg = sampler_config(stop=stops)
    out = sampler.generate(prompts, 4, seed=5)
    stopped = 0
    for r in range(len(out)):
        length = int(out.response_mask[r].sum())
        ids = out.response_ids[r, :length].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(s in out.response_text[r] for s in stops)
        if ids and ids[-1] != tokenizer.eos_token_id and not out.truncated[r]:
            assert text[-1] in stops and not any(s in text[:-1] for s in stops)
            assert out.response_text[r] == text[:-1]
            stopped += 1
        else:
            assert not any(s in text for s in stops)
    assert stopped > 0


def test_ignore_eos_generates_max_new_tokens_for_every_row(sampler, prompts, tokenizer):
    sampler.cfg = sampler_config(ignore_eos=True)
    out = sampler.generate(prompts, 2, seed=3)
    max_new = sampler.cfg.max_new_tokens
    assert out.response_length == max_new
    assert bool((out.response_mask.sum(dim=1) == max_new).all())
    assert bool(out.truncated.all())


def test_max_new_tokens_of_a_call_replaces_the_samplers_budget(sampler, prompts):
    """Validation passes eval.max_new_tokens to the rollout sampler for its greedy call."""
    sampler.cfg = sampler_config(ignore_eos=True)
    out = sampler.generate(prompts, 1, seed=0, greedy=True, max_new_tokens=3)
    assert out.response_length == 3 and bool((out.response_mask.sum(dim=1) == 3).all())
    assert sampler.generate(prompts, 1, seed=0, greedy=True).response_length == sampler.cfg.max_new_tokens


def test_temperature_of_a_call_replaces_the_samplers(sampler, prompts):
    """Sampled validation passes eval.temperature: the call samples as a sampler built with it."""
    sampler.cfg = sampler_config(temperature=0.5)
    own = sampler.generate(prompts, 2, seed=3)
    sampler.cfg = sampler_config(temperature=1.0)
    called = sampler.generate(prompts, 2, seed=3, temperature=0.5)
    assert torch.equal(own.input_ids, called.input_ids)
    assert torch.equal(own.sample_logprobs, called.sample_logprobs)
    assert not torch.equal(sampler.generate(prompts, 2, seed=3).sample_logprobs, called.sample_logprobs)


def test_same_seed_gives_the_same_tokens_and_another_seed_other_tokens(sampler, prompts):
    first = sampler.generate(prompts, 4, seed=11)
    again = sampler.generate(prompts, 4, seed=11)
    other = sampler.generate(prompts, 4, seed=12)
    assert torch.equal(first.input_ids, again.input_ids)
    assert torch.equal(first.sample_logprobs, again.sample_logprobs)
    assert not torch.equal(first.input_ids, other.input_ids)


def test_samples_of_one_prompt_differ(sampler, prompts):
    out = sampler.generate(prompts.select([2]), 4, seed=0)
    rows = {tuple(out.response_ids[r, : int(out.response_mask[r].sum())].tolist()) for r in range(4)}
    assert len(rows) > 1


def test_sampling_logprobs_are_under_the_top_k_filtered_tempered_policy(sampler, prompts, eos_model_dir):
    """With top_k=5, T=0.7: log_softmax over the 5 best of logits / T, and only those tokens are drawn."""
    sampler.cfg = sampler_config(top_k=5, temperature=0.7)
    out = sampler.generate(prompts, 4, seed=2)
    model = load_model(eos_model_dir)
    P, T = out.prompt_length, out.response_length
    with torch.no_grad():
        logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask,
                       position_ids=out.position_ids).logits[:, P - 1 : P + T - 1] / 0.7
    kth = logits.topk(5, dim=-1).values[..., -1:]
    filtered = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    expected = filtered.gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
    mask = out.response_mask.bool()
    assert torch.isfinite(expected[mask]).all(), "a token outside the top 5 was sampled"
    assert (expected[mask] - out.sample_logprobs[mask]).abs().max() < 1e-4


def test_hf_sampler_leaves_the_global_rng_untouched(hf_eos_sampler, prompts):
    state = torch.random.get_rng_state()
    hf_eos_sampler.generate(prompts, 2, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_greedy_decoding_agrees_between_hf_and_vllm(hf_eos_sampler, vllm_sampler, eos_state, prompts):
    vllm_sampler.load_weight_bucket(eos_state)
    vllm_sampler.finish_weight_sync()
    hf = hf_eos_sampler.generate(prompts, 1, seed=0, greedy=True)
    vl = vllm_sampler.generate(prompts, 1, seed=1, greedy=True)
    assert torch.equal(hf.input_ids, vl.input_ids)
    assert torch.equal(hf.truncated, vl.truncated)
    assert hf.response_text == vl.response_text
    assert (hf.sample_logprobs - vl.sample_logprobs).abs().max() < 1e-4


def test_hf_sampling_logprobs_match_a_plain_forward(hf_eos_sampler, prompts, eos_model_dir):
    hf_eos_sampler.cfg = sampler_config(temperature=0.7)
    out = hf_eos_sampler.generate(prompts, 2, seed=0)
    expected = reference_logprobs(load_model(eos_model_dir), out, temperature=0.7)
    assert (expected - out.sample_logprobs).abs().max() < 1e-4


def test_vllm_seeded_sampling_handles_more_prompt_tokens_than_one_engine_step(vllm_sampler, eos_state, tokenizer):
    """Prompts whose prefill spans several scheduler steps (chunked prefill would crash seeded CPU sampling)."""
    vllm_sampler.load_weight_bucket(eos_state)
    vllm_sampler.finish_weight_sync()
    budget = vllm_sampler.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = tokenizer("1 + 2 = ? " * 10)["input_ids"]
    count = budget // len(prompt) + 4
    prompts = prompts_to_batch([prompt] * count, tokenizer.pad_token_id)
    out = vllm_sampler.generate(prompts, 2, seed=0)
    assert len(out) == 2 * count and out.response_mask[:, 0].all()


def policy_logprobs(model_dir, out: Batch, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The trainer's recompute (`CausalLMPolicy`, chunked) of a rollout's response tokens."""
    from ppo_trainer.models.actor import CausalLMPolicy, load_causal_lm

    policy = CausalLMPolicy(load_causal_lm(str(model_dir)), chunk_tokens=5).eval()
    with torch.no_grad():
        logp, _ = policy(out.input_ids, out.attention_mask, out.position_ids, out.response_mask, temperature,
                         top_k=top_k, top_p=top_p)
    return logp


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (6, 0.8)])
def test_the_trainers_recompute_equals_the_sampling_logprobs_under_top_k_and_top_p(sampler, prompts, eos_model_dir,
                                                                                 top_k, top_p):
    sampler.cfg = sampler_config(top_k=top_k, top_p=top_p, temperature=0.7)
    out = sampler.generate(prompts, 4, seed=4)
    recomputed = policy_logprobs(eos_model_dir, out, 0.7, top_k, top_p)
    mask = out.response_mask.bool()
    assert (recomputed[mask] - out.sample_logprobs[mask]).abs().max() < 1e-4
    untruncated = policy_logprobs(eos_model_dir, out, 0.7)
    assert (untruncated[mask] - out.sample_logprobs[mask]).abs().max() > 1e-2  # the truncation matters here


@pytest.fixture(scope="module")
def leaky_model_dir(eos_model_dir, tmp_path_factory):
    """The EOS-prone model with a generation_config.json that sets sampling options of its own."""
    return with_leaky_generation_config(eos_model_dir, tmp_path_factory.mktemp("tiny-eos-leaky"))


def test_the_hf_sampler_ignores_the_models_generation_config(leaky_model_dir, prompts):
    hf = HFSampler(leaky_model_dir, sampler_config(temperature=0.9), batch_size=8)
    assert hf.model.generation_config.repetition_penalty == 1.8  # the model does carry its settings
    out = hf.generate(prompts, 4, seed=1)
    assert out.response_length > 2, "its min_p / max_new_tokens would end every response at once"
    mask = out.response_mask.bool()
    assert (policy_logprobs(leaky_model_dir, out, 0.9)[mask] - out.sample_logprobs[mask]).abs().max() < 1e-4


def test_the_vllm_sampler_ignores_the_models_generation_config(vllm_sampler, eos_state, eos_model_dir, prompts):
    assert "min_p" in vllm_sampler.llm.llm_engine.model_config.try_get_generation_config()  # the engine's model
    vllm_sampler.load_weight_bucket(eos_state)
    vllm_sampler.finish_weight_sync()
    vllm_sampler.cfg = sampler_config(temperature=0.9)
    out = vllm_sampler.generate(prompts, 4, seed=1)
    assert out.response_length > 2
    mask = out.response_mask.bool()
    assert (policy_logprobs(eos_model_dir, out, 0.9)[mask] - out.sample_logprobs[mask]).abs().max() < 1e-4


def test_complete_continues_each_context_under_its_own_settings_and_seed(sampler, prompts, eos_model_dir):
    """Rows of different budgets and temperatures in one call: each within its budget, its logprobs
    those of a forward at its temperature, the same seeds the same tokens; greedy is generate's greedy."""
    contexts = prompt_token_lists(prompts) * 2
    settings = [RowSampling(3), RowSampling(5, temperature=0.5), RowSampling(3, top_k=4)] * 2
    seeds = [7, 8, 9, 10, 11, 12]
    done = sampler.complete(contexts, seeds, settings)
    assert [c.token_ids for c in sampler.complete(contexts, seeds, settings)] == [c.token_ids for c in done]
    model = load_model(eos_model_dir)
    for context, setting, c in zip(contexts, settings, done):
        assert 1 <= len(c.token_ids) <= setting.max_new_tokens and len(c.logprobs) == len(c.token_ids)
        assert c.stopped == (c.token_ids[-1] == model.config.eos_token_id)
        with torch.no_grad():
            logits = model(torch.tensor([context + c.token_ids])).logits[0, len(context) - 1 : -1]
        logits = logits / (setting.temperature or sampler.cfg.temperature)
        if setting.top_k:
            logits = logits.masked_fill(logits < logits.topk(setting.top_k, dim=-1).values[:, -1:], float("-inf"))
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert (expected - torch.tensor(c.logprobs)).abs().max() < 1e-4
    greedy = sampler.complete(contexts[:3], [0, 1, 2], [RowSampling(MAX_NEW_TOKENS)] * 3, greedy=True)
    out = sampler.generate(prompts, 1, seed=0, greedy=True)
    assert [c.token_ids for c in greedy] == [out.response_ids[r, : int(out.response_mask[r].sum())].tolist()
                                             for r in range(3)]


def test_hf_complete_leaves_the_global_rng_untouched(hf_eos_sampler, prompts):
    state = torch.random.get_rng_state()
    hf_eos_sampler.complete(prompt_token_lists(prompts), [1, 2, 3], [RowSampling(4)] * 3)
    assert torch.equal(torch.random.get_rng_state(), state)
