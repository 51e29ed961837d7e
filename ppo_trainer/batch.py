"""`Batch`: everything one PPO step carries between roles, as CPU tensors with named shapes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Sequence

import torch


@dataclass
class Batch:
    """One step's sequences. Rows are sequences; a prompt's `n` samples are adjacent.

    Shapes (B sequences, P prompt tokens, T response tokens; prompts left-padded, responses
    right-padded, so the prompt/response boundary sits at column P for every row):

    | field           | shape     | meaning                                                        |
    |-----------------|-----------|----------------------------------------------------------------|
    | input_ids       | [B, P+T]  | prompt then response token ids (pad id in padding)             |
    | attention_mask  | [B, P+T]  | 1 on real prompt and response tokens                           |
    | position_ids    | [B, P+T]  | positions counted from the first real prompt token             |
    | response_mask   | [B, T]    | 1 on real response tokens, up to and including EOS             |
    | sample_logprobs | [B, T]    | the sampler's logprobs of the response tokens                  |
    | old_logprobs    | [B, T]    | the actor's logprobs before this step's update                 |
    | ref_logprobs    | [B, T]    | the reference policy's logprobs                                |
    | rollout_weights | [B, T]    | rollout correction weights on the policy loss (None: off)      |
    | values          | [B, T]    | V(s_t): the critic's value of the state before token t         |
    | scores          | [B]       | the reward function's score of each response                   |
    | token_rewards   | [B, T]    | score on the last response token minus the per-token KL term   |
    | advantages      | [B, T]    | GAE advantages (whitened if gae.normalize_advantages)          |
    | returns         | [B, T]    | advantages + values before whitening: the critic's targets     |
    | truncated       | [B]       | True where the response hit max_new_tokens without EOS        |

    Non-tensor fields are per-row lists: `prompt_text`, `response_text`, `ground_truth`,
    `prompt_index` (row of the source dataset). Fields not yet computed are None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: Optional[torch.Tensor] = None
    sample_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_weights: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None
    prompt_text: Optional[list[str]] = None
    response_text: Optional[list[str]] = None
    ground_truth: Optional[list[str]] = None
    prompt_index: Optional[list[int]] = None
    meta: dict[str, Any] = field(default_factory=dict)  # batch-level facts, e.g. {"pad_token_id": 0}

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        """P: columns of the (left-padded) prompt block."""
        return self.input_ids.shape[1] - self.response_length

    @property
    def response_length(self) -> int:
        """T: columns of the (right-padded) response block; 0 before generation."""
        return 0 if self.response_mask is None else self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, T] the response block of input_ids."""
        return self.input_ids[:, self.prompt_length :]

    def num_tokens(self) -> torch.Tensor:
        """[B] real (unpadded) tokens per row: prompt plus response."""
        return self.attention_mask.sum(dim=1)

    def _row_fields(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "meta" and getattr(self, f.name) is not None]

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows `index`, in that order (tensor fields and per-row lists alike)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for name in self._row_fields():
            value = getattr(self, name)
            out[name] = value[idx] if isinstance(value, torch.Tensor) else [value[i] for i in idx.tolist()]
        return replace(self, **out, meta=dict(self.meta))

    def split(self, sizes: int | Sequence[int]) -> list["Batch"]:
        """Consecutive chunks: of `sizes` rows each (int; the last may be smaller) or of the given sizes."""
        if isinstance(sizes, int):
            sizes = [min(sizes, len(self) - start) for start in range(0, len(self), sizes)]
        if sum(sizes) != len(self):
            raise ValueError(f"split sizes {list(sizes)} do not add up to the batch size {len(self)}")
        chunks, start = [], 0
        for size in sizes:
            chunks.append(self.select(range(start, start + size)))
            start += size
        return chunks

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches, in order. Widths must agree (pad before concatenating)."""
        first = batches[0]
        out = {}
        for name in first._row_fields():
            values = [getattr(b, name) for b in batches]
            if any(v is None for v in values):
                raise ValueError(f"cannot concatenate: field '{name}' is missing in some batches")
            out[name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]
        return replace(first, **out, meta=dict(first.meta))

    def to(self, device: torch.device | str) -> "Batch":
        """A copy with every tensor moved to `device`."""
        out = {n: getattr(self, n).to(device) for n in self._row_fields() if isinstance(getattr(self, n), torch.Tensor)}
        return replace(self, **out)

    def with_fields(self, **values: Any) -> "Batch":
        """A copy with the given fields set (e.g. `batch.with_fields(values=v)`)."""
        return replace(self, **values)
