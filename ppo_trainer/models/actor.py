"""The policy: a causal LM (optionally with a peft LoRA adapter) that scores response tokens.

The logprob of response token t (column P+t) comes from the logits at P+t-1, under the sampled
policy (temperature, top-k, top-p), in chunks: no [B, T, V] block of logits exists (V ~150k for Qwen).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ppo_trainer.config.schema import LoraConfig
from ppo_trainer.models.lora import add_lora
from ppo_trainer.models.packing import Layout, layout_for, on_response_tokens, states_before_response_tokens


def load_causal_lm(model_dir: str, *, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                   gradient_checkpointing: bool = False, lora: Optional[LoraConfig] = None,
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from an HF folder, in float32 by default (master weights; FSDP casts them for
    compute). With `lora.rank > 0`: a peft `PeftModel` (`models.lora.add_lora`), its frozen base in `dtype`."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation,
                                              trust_remote_code=trust_remote_code)
    lm.config.use_cache = False
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.rank > 0:
        lm = add_lora(lm, lora, task_type="CAUSAL_LM")
    return lm


def top_k_top_p_keep(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[N, V] bool, True where a sampler keeps the token of `logits` [N, V] (already divided by the
    temperature): top-k (ties at the boundary stay), then top-p on the top-k-renormalised
    distribution (drop tokens whose ascending cumulative probability is <= 1 - top_p, always keep
    the largest): the order and tie rules of transformers' TopK/TopPLogitsWarper and vLLM."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        keep = logits >= torch.topk(logits, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        ascending, order = torch.sort(logits.masked_fill(~keep, float("-inf")), dim=-1, descending=False)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False
        keep = keep & ~dropped.scatter(-1, order, dropped)
    return keep


def sampled_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[n, V] float32 log-probabilities of softmax(`logits` / temperature) truncated by
    `top_k_top_p_keep` (-inf outside) and the [n, V] kept set (None when nothing is truncated). The
    label of each row, `labels` [n], always counts as kept (it was sampled): where the trainer's logits
    put it just outside (rounding between engines, a policy that moved) its logprob stays finite.
    `logits` [n, V] float32 is divided in place (a [n, V] block fewer to allocate: page faults on a CPU)."""
    if temperature != 1.0:
        logits = logits.div_(temperature)
    if not (top_k > 0 or top_p < 1.0):
        return torch.log_softmax(logits, dim=-1), None
    keep = top_k_top_p_keep(logits.detach(), top_k, top_p).scatter_(-1, labels.unsqueeze(-1), True)
    return torch.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1), keep


def finite_log_probs(log_probs: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """`log_probs` [n, V] with 0 for the dropped tokens (p = 0, log p = -inf), so that p * log p is 0
    there and no 0 * inf reaches a gradient."""
    return log_probs if keep is None else torch.where(keep, log_probs, 0)


class FrozenHeadLogprobs(torch.autograd.Function):
    """Logprobs [n] of `labels` and entropies [n] (zeros unless `with_entropy`) of one chunk of
    `hidden` [n, H] through a frozen linear head (`weight` [V, H], `bias` [V] or None), differentiable
    in `hidden`. With z = (hidden @ weight.T + bias) / T and p the truncated softmax of z:
        d logp_i / d hidden_i = (weight[label_i] - p_i @ weight) / T
        d ent_i  / d hidden_i = -((p_i * (log p_i + ent_i)) @ weight) / T
    Each depends on row i alone, so the forward computes both ([n, H]) from the softmax it already
    holds, and the backward is a row-wise product: no [n, V] logits kept, recomputed or
    differentiated. A checkpointed chunk with a frozen head forwards the head twice and
    backpropagates through its softmax: one vocabulary matmul and ~6 [n, V] passes more."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                temperature: float, top_k: int, top_p: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, keep = sampled_log_probs(F.linear(hidden, weight, bias).float(), labels, temperature, top_k, top_p)
        logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        probs = log_probs.exp()
        # the matmuls in the head's dtype, as autograd's backward through the head would run them
        d_logp = (weight[labels].float() - (probs.to(weight.dtype) @ weight).float()).div_(temperature)
        ent = torch.zeros_like(logp)
        d_ent = None
        if with_entropy:
            finite = finite_log_probs(log_probs, keep)
            ent = -(probs * finite).sum(-1)
            weighted = probs.mul_(finite.add_(ent.unsqueeze(-1)))  # in place: probs and log_probs are spent
            d_ent = (weighted.to(weight.dtype) @ weight).float().div_(-temperature)
        ctx.save_for_backward(d_logp, d_ent)
        ctx.hidden_dtype = hidden.dtype
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_ent: torch.Tensor):  # noqa: ANN205
        d_logp, d_ent = ctx.saved_tensors
        grad = grad_logp.unsqueeze(-1) * d_logp
        if d_ent is not None:
            grad = grad.add_(grad_ent.unsqueeze(-1) * d_ent)
        return grad.to(ctx.hidden_dtype), None, None, None, None, None, None, None


def response_logprobs(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, temperature: float,
                      chunk_tokens: int, with_entropy: bool = False, top_k: int = 0,
                      top_p: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """float32 logprobs [N] (and entropies [N], None unless asked) of the token ids `labels` [N] under
    softmax(lm_head(hidden) / temperature), `hidden` [N, H] being the states that predict them, truncated
    to `top_k_top_p_keep` and renormalised (top_k=0 and top_p=1 truncate nothing; `sampled_log_probs`).

    Works in chunks of `chunk_tokens` rows: at most one [chunk, V] block of logits exists. Under
    autograd a frozen linear head (a LoRA actor's) takes `FrozenHeadLogprobs`; any other head's
    chunks are checkpointed (recomputed in the backward)."""

    def chunk_fn(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, keep = sampled_log_probs(lm_head(h).float(), y, temperature, top_k, top_p)
        logp = log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        # -sum p log p from the log-probabilities: logsumexp(z) - sum(p z) cancels two large
        # numbers and loses ~1e-4 in float32 once logits reach ~25
        ent = -(log_probs.exp() * finite_log_probs(log_probs, keep)).sum(-1) if with_entropy else torch.zeros_like(logp)
        return logp, ent

    trainable_head = any(p.requires_grad for p in lm_head.parameters())
    grad = torch.is_grad_enabled() and (hidden.requires_grad or trainable_head)
    frozen_linear = grad and not trainable_head and isinstance(lm_head, nn.Linear)
    empty = hidden.new_zeros(0, dtype=torch.float32)  # torch.cat needs one tensor when N = 0
    logps, ents = [empty], [empty]
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
        if frozen_linear:
            logp, ent = FrozenHeadLogprobs.apply(h, lm_head.weight, lm_head.bias, y, temperature, top_k, top_p,
                                                 with_entropy)
        elif grad:
            logp, ent = checkpoint(chunk_fn, h, y, use_reentrant=False)
        else:
            logp, ent = chunk_fn(h, y)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


class CausalLMPolicy(nn.Module):
    """A causal LM whose forward returns response-token logprobs (and entropies), not logits; one
    module (the FSDP root), so the chunked lm_head runs under FSDP's hooks too."""

    def __init__(self, lm: nn.Module, chunk_tokens: int = 1024, pack_sequences: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.pack_sequences = pack_sequences  # algorithm.pack_sequences

    @property
    def is_lora(self) -> bool:
        return hasattr(self.lm, "peft_config")

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (with LoRA layers injected, when there is an adapter)."""
        return self.lm.get_base_model() if self.is_lora else self.lm

    def decoder_layers(self) -> list[nn.Module]:
        """The transformer blocks, the units FSDP shards separately."""
        return list(self.hf_model.get_decoder().layers)

    @property
    def layout(self) -> Layout:
        """How its forwards lay out the rows (`models.packing`)."""
        return layout_for(self.hf_model, self.pack_sequences)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Within the block the module computes the base model (the reference policy); LoRA only."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        with self.lm.disable_adapter():
            # peft also freezes the adapter here, but FSDP2 picks each group's gradient dtypes from
            # requires_grad at its first forward, which may be this one (bf16 grads into fp32 weights)
            for param in trainable:
                param.requires_grad_(True)
            yield

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_mask: torch.Tensor, temperature: float, with_entropy: bool = False, top_k: int = 0,
                top_p: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logprobs [B, T] (and entropies [B, T]) of the response tokens; 0 where response_mask is 0.
        `top_k`, `top_p`: the sampler's truncation. input_ids, attention_mask, position_ids: [B, P+T];
        response_mask: [B, T] (T >= 1, P >= 1)."""
        P = input_ids.shape[1] - response_mask.shape[1]
        predicting = states_before_response_tokens(self.hf_model.get_decoder(), input_ids, attention_mask,
                                                   position_ids, response_mask, self.layout)
        labels = input_ids[:, P:][response_mask.bool()]
        logp, ent = response_logprobs(predicting, self.hf_model.get_output_embeddings(), labels, temperature,
                                      self.chunk_tokens, with_entropy, top_k, top_p)
        return on_response_tokens(logp, response_mask), (None if ent is None else on_response_tokens(ent, response_mask))

