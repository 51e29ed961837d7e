"""The sampler protocol and what every sampler shares. A sampler turns a prompt-only `Batch`
(left-padded, width P) into a rollout `Batch` of `len(prompts) * n` rows, row `i * n + j` being
sample `j` of prompt `i`, with a response block (width T, right-padded) after the prompt block:

| field           | shape    | meaning                                                            |
|-----------------|----------|--------------------------------------------------------------------|
| input_ids       | [B, P+T] | prompt block, then response block                                  |
| attention_mask  | [B, P+T] | prompt mask, then 1 on every real response token                   |
| position_ids    | [B, P+T] | 0 at the first real prompt token; the response continues counting  |
| response_mask   | [B, T]   | 1 on generated tokens up to and including EOS (or the stop token); |
|                 |          | multi-turn: 0 on observation tokens (attended, never trained)      |
| sample_logprobs | [B, T]   | the sampler's logprob of each generated token under the policy it  |
|                 |          | sampled from (logits / temperature, after top-k / top-p); 0 on pad |
|                 |          | and on observation tokens                                          |
| truncated       | [B]      | True where the response hit max_new_tokens without EOS or stop     |
|                 |          | (multi-turn: its last action did, or the episode ran out of        |
|                 |          | multi_turn.max_response_tokens)                                    |
| token_version   | [B, T]   | partial rollouts only (`PartialSampler`): the policy version that  |
|                 |          | sampled each token; 0 on pad and on observation tokens             |

`response_text`: decoded without special tokens, cut before the first stop string; the prompt's
fields (`prompt_text`, `ground_truth`, `data_source`, `extra_info`) repeat n times. A multi-turn
sampler (`multi_turn.MultiTurnSampler`) adds `turn_rewards` and `episodes` (see `Batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from ppo_trainer.batch import Batch


@dataclass(frozen=True)
class RowSampling:
    """One context's settings for `complete`; a None field takes the sampler's config value."""

    max_new_tokens: int
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None


@dataclass(frozen=True)
class Completion:
    """What a sampler generated after one context: `token_ids` up to and including EOS or the token
    that completed a stop string, their `logprobs` (as `sample_logprobs`), `stopped` (False: it hit
    max_new_tokens), `text` decoded without special tokens and cut before the first stop string;
    `versions`: each token's policy version where the sampler labels them (partial rollouts), else None."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool
    text: str
    versions: Optional[list[int]] = None


class Sampler(Protocol):
    """A rollout engine. `sleep` releases accelerator memory between rollouts, `wake` undoes it
    (no-ops where the engine cannot)."""

    def generate(self, batch: Batch, n: int, seed: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None) -> Batch:
        """`n` responses per prompt; the same weights, prompts and `seed` give the same tokens.
        `max_new_tokens` and `temperature` replace the sampler's for this call (validation's)."""
        ...

    def load_weight_bucket(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a part of the weights (whole layers; full HF names, LoRA merged into the base);
        `finish_weight_sync` after the last part makes the next `generate` use them."""
        ...

    def finish_weight_sync(self) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class PartialSampler(Sampler, Protocol):
    """A sampler whose generation continues across weight syncs (`sampler.partial_rollouts`): a sync
    pauses it rather than waiting for it, and each token records the policy version that sampled it
    (`Batch.token_version`)."""

    def set_policy_version(self, version: int) -> None:
        """The version of the weights loaded since the last `finish_weight_sync` (called before the
        next one): tokens sampled after that sync carry it."""
        ...


class ContinuingSampler(Sampler, Protocol):
    """A sampler that also continues given token contexts, one request per context (multi-turn turns).
    `eos_ids`: the token ids that end a response (the tokenizer's and the model's generation EOS)."""

    eos_ids: list[int]

    def complete(self, contexts: Sequence[Sequence[int]], seeds: Sequence[int], settings: Sequence[RowSampling],
                 greedy: bool = False) -> list[Completion]:
        """One `Completion` per context, generated after its tokens with its `settings` and under its
        seed (the same contexts, settings and seeds give the same tokens); the stop, EOS and logprob
        rules of `generate`. `greedy` overrides every row's temperature, top-k and top-p."""
        ...


def prompts_to_batch(prompt_ids: Sequence[Sequence[int]], pad_id: int, **row_lists: list[Any]) -> Batch:
    """A prompt-only Batch from token-id lists, left-padded; `row_lists` are per-row fields."""
    if not prompt_ids:
        raise ValueError("prompts_to_batch needs at least one prompt")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompts_to_batch: every prompt needs at least one token")
    for name, values in row_lists.items():
        if len(values) != len(prompt_ids):
            raise ValueError(f"prompts_to_batch: '{name}' has {len(values)} rows, prompt_ids has {len(prompt_ids)}")
    rows = [torch.as_tensor(list(p), dtype=torch.long) for p in prompt_ids]
    input_ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left")
    attention_mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        **{name: list(values) for name, values in row_lists.items()},
        meta={"pad_token_id": pad_id},
    )


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] positions: 0 at the first real token, counting on to the right; 0 on left padding."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def prompt_token_lists(batch: Batch) -> list[list[int]]:
    """The real (unpadded) prompt tokens of each row of a prompt-only batch."""
    if batch.response_mask is not None:
        raise ValueError("generate expects a prompt-only batch (response_mask is set: it already holds responses)")
    mask = batch.attention_mask.bool()
    return [batch.input_ids[i][mask[i]].tolist() for i in range(len(batch))]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def assemble_rollout(prompts: Batch, n: int, responses: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                     truncated: Sequence[bool], texts: Sequence[str], pad_id: int, *,
                     response_masks: Optional[Sequence[Sequence[int]]] = None,
                     prompt_ids: Optional[Sequence[Optional[Sequence[int]]]] = None,
                     versions: Optional[Sequence[Sequence[int]]] = None) -> Batch:
    """The rollout Batch from per-row results (row i*n+j: sample j of prompt i): `responses[r]`
    the real tokens (ending with EOS or the stop token unless truncated), `logprobs[r]` theirs.
    Multi-turn rows: `response_masks[r]` 1 on the policy's tokens, 0 on the observations between
    them (attended, positions counting on, logprob 0); `prompt_ids[r]` replaces that row's prompt
    when not None (the prompt block is then left-padded to the widest). `versions[r]`, partial
    rollouts: each token's policy version (`token_version`; 0 on observations)."""
    rows = len(prompts) * n
    if not (len(responses) == len(logprobs) == len(truncated) == len(texts) == rows):
        raise ValueError(f"assemble_rollout: expected {rows} sequences ({len(prompts)} prompts x n={n})")
    masks = [[1] * len(ids) for ids in responses] if response_masks is None else response_masks
    width = max(1, max(len(r) for r in responses))
    response_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    response_real = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    sample_logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for r, (ids, lps, mask) in enumerate(zip(responses, logprobs, masks)):
        if not len(ids) == len(lps) == len(mask):
            raise ValueError(f"assemble_rollout: row {r} has {len(ids)} tokens, {len(lps)} logprobs, {len(mask)} mask")
        response_ids[r, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        response_real[r, : len(ids)] = 1
        response_mask[r, : len(ids)] = torch.as_tensor(list(mask), dtype=torch.long)
        sample_logprobs[r, : len(lps)] = torch.as_tensor(list(lps), dtype=torch.float32)
    sample_logprobs = torch.where(response_mask.bool(), sample_logprobs, 0)  # observations: none of the policy's
    if versions is not None and [len(v) for v in versions] != [len(ids) for ids in responses]:
        raise ValueError("assemble_rollout: each row needs one version per token")
    token_version = None if versions is None else torch.where(response_mask.bool(), padded_rows(versions, width), 0)

    repeated = prompts.select(torch.arange(len(prompts)).repeat_interleave(n))
    if prompt_ids is not None and any(p is not None for p in prompt_ids):
        own = prompt_token_lists(repeated)
        replaced = prompts_to_batch([own[r] if p is None else p for r, p in enumerate(prompt_ids)], pad_id)
        repeated = repeated.with_fields(input_ids=replaced.input_ids, attention_mask=replaced.attention_mask)
    prompt_mask = repeated.attention_mask.long()
    prompt_positions = positions_from_mask(prompt_mask)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, width + 1).unsqueeze(0)
    return repeated.with_fields(
        input_ids=torch.cat([repeated.input_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_real], dim=1),
        position_ids=torch.cat([prompt_positions, response_positions], dim=1),
        response_mask=response_mask,
        sample_logprobs=sample_logprobs,
        truncated=torch.as_tensor(list(truncated), dtype=torch.bool),
        token_version=token_version,
        response_text=list(texts),
        meta={**prompts.meta, "pad_token_id": pad_id},
    )


def padded_rows(rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """[len(rows), width] int64: each row's integers from column 0, 0 after them."""
    out = torch.zeros((len(rows), width), dtype=torch.long)
    for r, values in enumerate(rows):
        out[r, : len(values)] = torch.as_tensor(list(values), dtype=torch.long)
    return out
