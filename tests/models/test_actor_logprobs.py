"""The policy's response logprobs: chunked == full softmax, alignment, temperature, LoRA reference."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ppo_trainer.config.schema import LoraConfig
from ppo_trainer.models.actor import CausalLMPolicy, load_causal_lm, response_logprobs
from ppo_trainer.models.lora import lora_scalings, merge_lora_state_dict


class PeakMemory(TorchDispatchMode):
    """Peak bytes of CPU tensor storages created inside the block and alive at the same time.

    Storages are tracked from the op that creates them until they are freed (weakref finalizer;
    PyTorch keeps a storage's Python object alive as long as the storage itself), so tensors saved
    for backward count until backward releases them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._release, key)
        return out


def full_softmax(hidden, lm_head, labels, temperature):
    logits = lm_head(hidden) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, labels[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def big_vocab_case(n_tokens=96, hidden_size=16, vocab=32768, head_trainable=True):
    """hidden [n_tokens, hidden_size] (requires grad), a linear head (frozen unless `head_trainable`:
    a LoRA actor's head takes `FrozenHeadLogprobs`, a trainable one checkpointed chunks), labels."""
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden_size, generator=gen))
    lm_head.requires_grad_(head_trainable)
    hidden = torch.randn(n_tokens, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n_tokens,), generator=gen)
    return hidden, lm_head, labels


HEADS = pytest.mark.parametrize("head_trainable", [True, False], ids=["trainable_head", "frozen_head"])


@HEADS
def test_chunked_logprobs_and_entropy_equal_a_float64_full_softmax_values_and_gradients(head_trainable):
    hidden, lm_head, labels = big_vocab_case(head_trainable=head_trainable)
    logp, ent = response_logprobs(hidden, lm_head, labels, temperature=0.7, chunk_tokens=10, with_entropy=True)
    (logp.sum() + 0.3 * ent.sum()).backward()

    hidden64 = hidden.detach().double().requires_grad_(True)
    head64 = torch.nn.Linear(hidden.shape[1], lm_head.out_features, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head64.weight.copy_(lm_head.weight)
    ref_logp, ref_ent = full_softmax(hidden64, head64, labels, 0.7)
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()

    # A float32 logit z (a 16-term dot product, then / T) is off by a few eps x max|z| (max|z| ~ 41
    # here); a logprob z_y - logsumexp(z) by twice that, and an entropy, sum_i p_i (1 + log p_i)
    # dz_i, by (1 + H) times twice that. Measured, in units of eps x max|z| (x (1 + H) for the
    # entropy): logprobs 2.1, entropies 2.2 on an AVX2 CPU (whose summation order differs from
    # AVX-512's); the cancelling logsumexp(z) - sum(p z) form of the entropy reaches 33.
    with torch.no_grad():
        logit_error = 4 * torch.finfo(torch.float32).eps * (hidden64 @ head64.weight.T / 0.7).abs().amax(-1)
    logp_ratio = (logp.double() - ref_logp).abs() / (2 * logit_error)
    ent_ratio = (ent.double() - ref_ent).abs() / ((1 + ref_ent.detach()) * 2 * logit_error)
    assert logp_ratio.max() <= 1, f"logprob error {logp_ratio.max():.2f}x its float32 bound"
    assert ent_ratio.max() <= 1, f"entropy error {ent_ratio.max():.2f}x its float32 bound"
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, atol=1e-4, rtol=1e-4)
    if head_trainable:
        torch.testing.assert_close(lm_head.weight.grad.double(), head64.weight.grad, atol=1e-4, rtol=1e-4)
    else:
        assert lm_head.weight.grad is None


@pytest.mark.parametrize("with_entropy", [True, False])
def test_frozen_head_gradients_weight_logprob_and_entropy_by_their_own_upstream_gradients(with_entropy):
    """`FrozenHeadLogprobs` against autograd through a float64 full softmax, with per-token upstream
    gradients (as the PPO loss gives them), a bias, temperature, and a label outside the top-k."""
    hidden, lm_head, labels = big_vocab_case(n_tokens=12, vocab=300, head_trainable=False)
    lm_head.bias = torch.nn.Parameter(torch.linspace(-1, 1, 300), requires_grad=False)
    gen = torch.Generator().manual_seed(1)
    upstream_logp, upstream_ent = torch.randn(12, generator=gen), torch.randn(12, generator=gen)
    logp, ent = response_logprobs(hidden, lm_head, labels, 0.8, chunk_tokens=5, with_entropy=with_entropy, top_k=40)
    loss = (upstream_logp * logp).sum() + ((upstream_ent * ent).sum() if with_entropy else 0)
    loss.backward()

    hidden64 = hidden.detach().double().requires_grad_(True)
    with torch.no_grad():
        logits = (hidden64 @ lm_head.weight.double().T + lm_head.bias.double()) / 0.8
        keep = logits >= torch.topk(logits, 40, dim=-1).values[:, -1:]
        keep[torch.arange(12), labels] = True
    log_probs = torch.log_softmax(((hidden64 @ lm_head.weight.double().T + lm_head.bias.double()) / 0.8)
                                  .masked_fill(~keep, float("-inf")), dim=-1)
    ref_logp = log_probs.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(log_probs.exp() * torch.where(keep, log_probs, 0)).sum(-1)
    ref_loss = (upstream_logp * ref_logp).sum() + ((upstream_ent * ref_ent).sum() if with_entropy else 0)
    ref_loss.backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=0)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, atol=1e-5, rtol=1e-4)


def test_frozen_head_bf16_gradient_matches_autograd_through_the_same_bf16_head():
    """In bf16 both routes multiply by the head in bf16 (autograd casts d logits to bf16, the
    fused forward casts p): they agree to bf16's rounding of those products, measured against
    the size of the gradient (relative error <= a few units of bf16's eps)."""
    hidden, lm_head, labels = big_vocab_case(n_tokens=16, vocab=512, head_trainable=False)
    lm_head = lm_head.to(torch.bfloat16)
    hidden = hidden.detach().to(torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(16, generator=torch.Generator().manual_seed(2))
    logp, _ = response_logprobs(hidden, lm_head, labels, 0.7, chunk_tokens=6)
    (upstream * logp).sum().backward()

    hidden_ref = hidden.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(lm_head(hidden_ref).float() / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)
    (upstream * ref).sum().backward()
    torch.testing.assert_close(logp, ref.detach(), atol=0, rtol=0)
    error = (hidden.grad.float() - hidden_ref.grad.float()).norm() / hidden_ref.grad.float().norm()
    assert error <= 4 * torch.finfo(torch.bfloat16).eps, f"relative gradient error {error:.2e}"


@HEADS
def test_chunked_logprobs_use_less_peak_memory_than_full_softmax(head_trainable):
    hidden, lm_head, labels = big_vocab_case(head_trainable=head_trainable)
    n_tokens, vocab, chunk = hidden.shape[0], lm_head.out_features, 8

    with PeakMemory() as chunked:
        logp, ent = response_logprobs(hidden, lm_head, labels, 1.0, chunk_tokens=chunk, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
    hidden.grad, lm_head.weight.grad = None, None
    lm_head.requires_grad_(True)  # the reference's full [N, V] softmax, kept for its backward either way
    with PeakMemory() as full:
        ref_logp, ref_ent = full_softmax(hidden, lm_head, labels, 1.0)
        (ref_logp.sum() + ref_ent.sum()).backward()

    full_logits_bytes = n_tokens * vocab * 4
    assert full.peak >= full_logits_bytes  # the [N, V] float32 logits exist at once
    assert chunked.peak < full_logits_bytes  # ... and never in the chunked computation
    assert chunked.peak * 3 < full.peak


def make_batch(rows: list[tuple[list[int], list[int]]], pad_id: int = 0):
    """input_ids, attention_mask, position_ids, response_mask for (prompt ids, response ids) rows."""
    P = max(len(p) for p, _ in rows)
    T = max(len(r) for _, r in rows)
    ids = torch.full((len(rows), P + T), pad_id)
    attn = torch.zeros(len(rows), P + T, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P] = torch.tensor(p)
        ids[i, P : P + len(r)] = torch.tensor(r)
        attn[i, P - len(p) : P + len(r)] = 1
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    return ids, attn, pos, attn[:, P:].clone()


ROWS = [([5, 9, 14, 3], [20, 21, 22]), ([7, 8], [30, 31, 32, 33, 34]), ([11, 12, 13], [40])]


def test_logprob_of_token_t_comes_from_position_P_plus_t_minus_1_at_temperature(tiny_model_dir):
    lm = load_causal_lm(str(tiny_model_dir))
    policy = CausalLMPolicy(lm, chunk_tokens=3).eval()
    with torch.no_grad():
        for i, (prompt, response) in enumerate(ROWS):  # each row alone, unpadded, as ground truth
            ids = torch.tensor([prompt + response])
            logits = lm(input_ids=ids).logits[0].float() / 0.6
            expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]
            ids_b, attn, pos, mask = make_batch(ROWS)
            logp, _ = policy(ids_b, attn, pos, mask, temperature=0.6)
            torch.testing.assert_close(logp[i, : len(response)], expected, atol=1e-5, rtol=0)
            assert torch.all(logp[i, len(response) :] == 0)


def test_lora_reference_equals_base_model_exactly_and_zero_B_actor_equals_reference(tiny_model_dir):
    base = CausalLMPolicy(load_causal_lm(str(tiny_model_dir))).eval()
    lora = CausalLMPolicy(load_causal_lm(str(tiny_model_dir), lora=LoraConfig(rank=4, alpha=8))).eval()
    batch = make_batch(ROWS)
    with torch.no_grad():
        base_logp, _ = base(*batch, temperature=1.0)
        actor_logp, _ = lora(*batch, temperature=1.0)  # lora_B starts at zero: the identity
        with lora.adapter_disabled():
            ref_logp, _ = lora(*batch, temperature=1.0)
        assert torch.equal(actor_logp, ref_logp)
        assert torch.equal(ref_logp, base_logp)

        for name, p in lora.named_parameters():  # move the adapter away from the identity
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        moved, _ = lora(*batch, temperature=1.0)
        with lora.adapter_disabled():
            ref_after, _ = lora(*batch, temperature=1.0)
    assert (moved - base_logp).abs().max() > 1e-3
    assert torch.equal(ref_after, base_logp)


def test_merged_lora_state_dict_loads_into_the_plain_model_with_the_adapters_outputs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    lora = CausalLMPolicy(load_causal_lm(str(tiny_model_dir), lora=LoraConfig(rank=4, alpha=8))).eval()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    merged = merge_lora_state_dict(lora.lm.state_dict(), lora_scalings(lora.lm))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    batch = make_batch(ROWS)
    with torch.no_grad():
        expected, _ = lora(*batch, temperature=1.0)
        got, _ = CausalLMPolicy(plain).eval()(*batch, temperature=1.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def chunking_tolerances(lm, batch, temperature: float) -> tuple[float, float]:
    """Bounds on how far two chunkings may differ in float32: chunking changes only the
    summation order inside lm_head's length-H dot products, so each logit z moves by at most
    delta = 2 * H * eps * max(|h| @ |W|^T) / temperature (twice the gamma_H rounding bound of a
    dot product); a logprob z_y - logsumexp(z) then by 2 * delta, an entropy logsumexp(z) - E_p[z]
    by delta * (max z - min z)."""
    with torch.no_grad():
        hidden = lm.model(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).last_hidden_state
        weight = lm.lm_head.weight
        eps = torch.finfo(torch.float32).eps
        delta = 2 * hidden.shape[-1] * eps * (hidden.abs() @ weight.abs().T).max().item() / temperature
        logits = hidden @ weight.T / temperature
        spread = (logits.max(-1).values - logits.min(-1).values).max().item()
    return 2 * delta, delta * spread


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_policy_logprobs_do_not_depend_on_the_chunk_size(tiny_model_dir, chunk_tokens):
    lm = load_causal_lm(str(tiny_model_dir))
    batch = make_batch(ROWS)
    logp_tol, ent_tol = chunking_tolerances(lm, batch, 0.8)
    with torch.no_grad():
        ref, ref_ent = CausalLMPolicy(lm, chunk_tokens=10_000).eval()(*batch, temperature=0.8, with_entropy=True)
        got, ent = CausalLMPolicy(lm, chunk_tokens=chunk_tokens).eval()(*batch, temperature=0.8, with_entropy=True)
    torch.testing.assert_close(got, ref, atol=logp_tol, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ent_tol, rtol=0)
    assert torch.all(ent[batch[3] == 0] == 0)
    assert torch.all(ent[batch[3] == 1] > 0)


TRUNCATIONS = [(5, 1.0), (0, 0.8), (7, 0.6), (1, 1.0), (0, 0.05)]  # (top_k, top_p)


def hf_processed_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The reference: transformers' own warpers, in the order generate applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


@HEADS
@pytest.mark.parametrize("top_k,top_p", TRUNCATIONS)
def test_truncated_logprobs_and_entropy_equal_hf_top_k_then_top_p_warpers(top_k, top_p, head_trainable):
    """Tokens drawn from the warped distribution: their chunked logprobs and the entropies equal
    log_softmax of HF's processed scores (float64 for the entropy reference); gradients finite.
    Tokens 0-3 tie for the top of every row, so top-k keeps ties and top-p splits them as HF does."""
    hidden, plain_head, _ = big_vocab_case(n_tokens=40, vocab=512)
    lm_head = torch.nn.Linear(hidden.shape[1], 512)
    with torch.no_grad():
        lm_head.weight.copy_(plain_head.weight)
        lm_head.weight[1:4] = lm_head.weight[0]
        lm_head.bias.zero_()
        lm_head.bias[:4] = 6.0
        logits = lm_head(hidden).float()
    lm_head.requires_grad_(head_trainable)
    assert (logits[:, 1:4] == logits[:, :1]).all()
    processed = hf_processed_logits(logits, 0.7, top_k, top_p)
    labels = torch.multinomial(processed.softmax(-1), 1, generator=torch.Generator().manual_seed(0)).squeeze(-1)

    logp, ent = response_logprobs(hidden, lm_head, labels, 0.7, chunk_tokens=7, with_entropy=True,
                                  top_k=top_k, top_p=top_p)
    expected = torch.log_softmax(processed, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    p64 = processed.double().softmax(-1)
    ref_ent = -(p64 * torch.where(p64 > 0, p64.log(), 0)).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(hidden.grad).all()
    assert not head_trainable or torch.isfinite(lm_head.weight.grad).all()


def test_a_token_outside_the_truncated_set_keeps_a_finite_logprob():
    """A sampled token counts as kept (the sampler drew it, so it was in its set): when the
    trainer's logits put it just outside, its logprob is finite, renormalised over set + token."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    lm_head = torch.nn.Linear(5, 5, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.eye(5))
    logp, ent = response_logprobs(logits, lm_head, torch.tensor([3]), 1.0, chunk_tokens=4, with_entropy=True, top_k=2)
    kept = torch.tensor([4.0, 3.0, 1.0])
    torch.testing.assert_close(logp, (1.0 - torch.logsumexp(kept, 0)).reshape(1))
    assert torch.isfinite(ent).all()


@HEADS
def test_truncated_chunked_logprobs_never_hold_the_full_logits(head_trainable):
    hidden, lm_head, labels = big_vocab_case(head_trainable=head_trainable)
    full_logits_bytes = hidden.shape[0] * lm_head.out_features * 4
    with PeakMemory() as chunked:
        logp, ent = response_logprobs(hidden, lm_head, labels, 1.0, chunk_tokens=8, with_entropy=True,
                                      top_k=50, top_p=0.9)
        (logp.sum() + ent.sum()).backward()
    assert chunked.peak < full_logits_bytes
