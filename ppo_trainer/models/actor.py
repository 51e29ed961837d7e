"""The policy: a causal LM (optionally with a peft LoRA adapter) that scores response tokens.

The logprob of response token t (column P+t) comes from the logits at P+t-1, under the sampled
policy (temperature, top-k, top-p), in chunks: no [B, T, V] block of logits exists (V ~150k for Qwen).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ppo_trainer.config import LoraConfig
from ppo_trainer.models.packing import on_response_tokens, states_before_response_tokens


def load_causal_lm(model_dir: str, *, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                   gradient_checkpointing: bool = False, lora: Optional[LoraConfig] = None,
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from an HF folder, in float32 by default (master weights; FSDP casts them for
    compute). With `lora.rank > 0`: a peft `PeftModel`, base frozen (in `dtype`), the adapter in float32
    (peft upcasts it), LoRA B at zero (identity)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation,
                                              trust_remote_code=trust_remote_code)
    lm.config.use_cache = False
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.rank > 0:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lm = get_peft_model(lm, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=list(lora.target_modules), bias="none",
                                               task_type="CAUSAL_LM"))
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


def response_logprobs(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, temperature: float,
                      chunk_tokens: int, with_entropy: bool = False, top_k: int = 0,
                      top_p: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """float32 logprobs [N] (and entropies [N], None unless asked) of the token ids `labels` [N] under
    softmax(lm_head(hidden) / temperature), `hidden` [N, H] being the states that predict them, truncated
    to `top_k_top_p_keep` and renormalised (top_k=0 and top_p=1 truncate nothing).

    A label always counts as kept (it was sampled): where the trainer's logits put it just outside
    (rounding between engines, a policy that moved) its logprob stays finite. Works in chunks of
    `chunk_tokens` rows, each checkpointed under autograd: at most one [chunk, V] block of logits."""
    truncated = top_k > 0 or top_p < 1.0

    def chunk_fn(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lm_head(h).float()
        if temperature != 1.0:  # in place: a [chunk, V] block fewer to allocate (page faults on a CPU)
            logits = logits.div_(temperature)
        if truncated:
            keep = top_k_top_p_keep(logits.detach(), top_k, top_p).scatter_(-1, y.unsqueeze(-1), True)
            logits = logits.masked_fill(~keep, float("-inf"))
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        ent = torch.zeros_like(logp)
        if with_entropy:
            # -sum p log p from the log-probabilities: logsumexp(z) - sum(p z) cancels two large
            # numbers and loses ~1e-4 in float32 once logits reach ~25. Dropped tokens have p = 0
            # and log p = -inf: their term is 0, written so that no 0 * inf reaches a gradient.
            finite_log_probs = torch.where(keep, log_probs, 0) if truncated else log_probs
            ent = -(log_probs.exp() * finite_log_probs).sum(-1)
        return logp, ent

    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    empty = hidden.new_zeros(0, dtype=torch.float32)  # torch.cat needs one tensor when N = 0
    logps, ents = [empty], [empty]
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
        logp, ent = checkpoint(chunk_fn, h, y, use_reentrant=False) if grad else chunk_fn(h, y)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


class CausalLMPolicy(nn.Module):
    """A causal LM whose forward returns response-token logprobs (and entropies), not logits; one
    module (the FSDP root), so the chunked lm_head runs under FSDP's hooks too."""

    def __init__(self, lm: nn.Module, chunk_tokens: int = 1024) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

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
                                                   position_ids, response_mask)
        labels = input_ids[:, P:][response_mask.bool()]
        logp, ent = response_logprobs(predicting, self.hf_model.get_output_embeddings(), labels, temperature,
                                      self.chunk_tokens, with_entropy, top_k, top_p)
        return on_response_tokens(logp, response_mask), (None if ent is None else on_response_tokens(ent, response_mask))


def lora_scalings(policy: CausalLMPolicy) -> dict[str, tuple[float, bool]]:
    """(scaling = alpha / r, fan_in_fan_out) per adapted module, keyed by its name in `policy.lm`."""
    from peft.tuners.lora import LoraLayer

    return {name: (float(module.scaling["default"]), bool(getattr(module, "fan_in_fan_out", False)))
            for name, module in policy.lm.named_modules()
            if isinstance(module, LoraLayer) and "default" in module.scaling}


def merge_lora_state_dict(state: dict[str, torch.Tensor],
                          scalings: dict[str, tuple[float, bool]]) -> dict[str, torch.Tensor]:
    """A `PeftModel.state_dict()` -> the merged base model's: W = W_base + scaling * B @ A; keys
    lose the "base_model.model." prefix and the ".base_layer" infix, LoRA matrices are dropped."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        wrapped, _, leaf = key.rpartition(".")
        module = wrapped.removesuffix(".base_layer")
        if module != wrapped and leaf == "weight" and module in scalings:
            scaling, fan_in_fan_out = scalings[module]
            delta = state[f"{module}.lora_B.default.weight"] @ state[f"{module}.lora_A.default.weight"]
            value = value + scaling * (delta.T if fan_in_fan_out else delta)
        merged[f"{module}.{leaf}".removeprefix("base_model.model.")] = value
    return merged
