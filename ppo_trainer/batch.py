"""`Batch`: everything one PPO step carries between roles, as CPU tensors with named shapes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Sequence

import torch


def _response() -> Any:
    """A [B, T] field: its columns are the response block's."""
    return field(default=None, metadata={"block": "response"})


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> list[list[int]]:
    """Row indices of the rows with identical prompts (tokens and mask of the prompt block), each
    group in row order, groups in the order of their first row. input_ids, attention_mask: [B, P+T]."""
    groups: dict[tuple, list[int]] = {}
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1)
    for row, key in enumerate(map(tuple, prompts.tolist())):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def row_extents(attention_mask: torch.Tensor, response_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] prompt lengths and [B] response lengths (up to each block's last real token) of rows with
    attention_mask [B, P+T] and response_mask [B, T] (None before generation: T = 0)."""
    T = 0 if response_mask is None else response_mask.shape[1]
    P = attention_mask.shape[1] - T
    prompt_lens = ((attention_mask[:, :P] != 0) * torch.arange(P, 0, -1)).amax(dim=1)
    if T == 0:
        return prompt_lens, torch.zeros_like(prompt_lens)
    response_real = (attention_mask[:, P:] != 0) | (response_mask != 0)
    return prompt_lens, (response_real * torch.arange(1, T + 1)).amax(dim=1)


@dataclass
class Batch:
    """One step's sequences. Rows are sequences; a prompt's `n` samples are adjacent.

    Shapes (B sequences, P prompt tokens, T response tokens; prompts left-padded, responses
    right-padded, so the prompt/response boundary sits at column P for every row):

    | field           | shape     | meaning                                                        |
    |-----------------|-----------|----------------------------------------------------------------|
    | input_ids       | [B, P+T]  | prompt then response token ids (pad id in padding)             |
    | attention_mask  | [B, P+T]  | 1 on real prompt and response tokens (observations included)   |
    | position_ids    | [B, P+T]  | positions counted from the first real prompt token             |
    | response_mask   | [B, T]    | 1 on the policy's response tokens, up to and including EOS;    |
    |                 |           | multi-turn: 0 on observation tokens (attended, out of every    |
    |                 |           | loss, KL, entropy and advantage)                               |
    | sample_logprobs | [B, T]    | the sampler's logprobs of the policy's tokens, 0 elsewhere     |
    | old_logprobs    | [B, T]    | the actor's logprobs before this step's update                 |
    | ref_logprobs    | [B, T]    | the reference policy's logprobs                                |
    | rollout_weights | [B, T]    | rollout correction weights on the policy loss (None: off)      |
    | values          | [B, T]    | V(s_t): the critic's value of the state before token t; None   |
    |                 |           | for a critic-free algorithm.adv_estimator                      |
    | scores          | [B]       | each response's score, less the length shaping (reward.*)       |
    | advantages      | [B, T]    | algorithm.adv_estimator's (gae: GAE's, whitened if             |
    |                 |           | gae.normalize_advantages)                                      |
    | returns         | [B, T]    | gae: the advantages before whitening + values: critic targets  |
    | truncated       | [B]       | True where the response hit max_new_tokens without EOS        |
    |                 |           | (multi-turn: its last turn did, or the episode ran out of      |
    |                 |           | multi_turn.max_response_tokens)                                |
    | positive        | [B]       | True on the responses the positive-example LM loss imitates    |
    | turn_rewards    | [B, T]    | multi-turn: each turn's environment reward on that turn's last |
    |                 |           | policy token, 0 elsewhere; None for single-turn rollouts       |
    | policy_version  | [B]       | int64: the step whose updated weights sampled the row (0: the  |
    |                 |           | initial ones; partial rollouts: those it started with); set by |
    |                 |           | the driver's `run.pipeline`                                    |
    | token_version   | [B, T]    | int64, partial rollouts only (sampler.partial_rollouts): the   |
    |                 |           | step whose weights sampled each token (a row cut by a weight   |
    |                 |           | push holds two or more); 0 on pad and observation tokens       |

    Non-tensor fields are per-row lists (prompt_text: the prompt's display text; prompt_messages: its
    chat turns, which a reward model renders in its own template; ground_truth, data_source,
    extra_info: its record's, as in the data; episodes: multi-turn rollouts' per-row dicts, `turns`
    [{"role": "assistant" | "tool" | "environment", "content": str}, ...], `num_turns`, `tool_calls`,
    `tool_errors`, `tool_timeouts`, `observation_tokens`, `end` (env_done | no_tool_call | max_turns |
    max_response_tokens), `extra_logs` {name: float}); fields not yet computed are None. Each [B, P+T] or
    [B, T] field names its column block in its metadata, which the reshaping methods follow.
    """

    input_ids: torch.Tensor = field(metadata={"block": "full", "pad": "pad_id"})
    attention_mask: torch.Tensor = field(metadata={"block": "full"})
    position_ids: torch.Tensor = field(metadata={"block": "full", "pad": "positions"})
    response_mask: Optional[torch.Tensor] = _response()
    sample_logprobs: Optional[torch.Tensor] = _response()
    old_logprobs: Optional[torch.Tensor] = _response()
    ref_logprobs: Optional[torch.Tensor] = _response()
    rollout_weights: Optional[torch.Tensor] = _response()
    values: Optional[torch.Tensor] = _response()
    scores: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = _response()
    returns: Optional[torch.Tensor] = _response()
    truncated: Optional[torch.Tensor] = None
    positive: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = _response()
    policy_version: Optional[torch.Tensor] = None
    token_version: Optional[torch.Tensor] = _response()
    prompt_text: Optional[list[str]] = None
    prompt_messages: Optional[list[list[dict[str, Any]]]] = None
    response_text: Optional[list[str]] = None
    ground_truth: Optional[list[Any]] = None
    data_source: Optional[list[str]] = None
    extra_info: Optional[list[Any]] = None
    episodes: Optional[list[dict[str, Any]]] = None
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

    def require(self, *names: str, user: str) -> None:
        """Raise naming the first of the fields `names` that is not computed yet; `user` needs it."""
        for name in names:
            if getattr(self, name) is None:
                raise ValueError(f"batch.{name} is None; {user} needs it (compute it first)")

    def _row_fields(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "meta" and getattr(self, f.name) is not None]

    def _blocks(self) -> dict[str, dict]:
        """Set fields with a column block -> their metadata (block "full" or "response", pad)."""
        return {f.name: f.metadata for f in fields(self) if "block" in f.metadata and getattr(self, f.name) is not None}

    def row_extents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] prompt lengths and [B] response lengths, as `row_extents`."""
        return row_extents(self.attention_mask, self.response_mask)

    def trim_padding(self) -> "Batch":
        """The same rows without the columns that are padding in every row (left of the prompts,
        right of the responses; at least one of each kept)."""
        P, T = self.prompt_length, self.response_length
        prompt_lens, response_lens = self.row_extents()
        keep_p = max(1, int(prompt_lens.max()))
        keep_t = max(1, int(response_lens.max())) if T > 0 else 0
        cols = {"full": slice(P - keep_p, P + keep_t), "response": slice(0, keep_t)}
        return self.with_fields(**{n: getattr(self, n)[:, cols[m["block"]]] for n, m in self._blocks().items()})

    def pad_responses(self, width: int) -> "Batch":
        """The response block right-padded to `width` columns: pad id in input_ids, positions
        counting on in position_ids, 0 elsewhere."""
        extra = width - self.response_length
        if extra == 0:
            return self
        out = {}
        for name, meta in self._blocks().items():
            value = getattr(self, name)
            if meta.get("pad") == "positions":
                out[name] = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1)], dim=1)
            else:
                fill = self.meta.get("pad_token_id", 0) if meta.get("pad") == "pad_id" else 0
                out[name] = torch.nn.functional.pad(value, (0, extra), value=fill)
        return self.with_fields(**out)

    def pad_prompts(self, width: int) -> "Batch":
        """The prompt block left-padded to `width` columns: pad id in input_ids, 0 in the attention
        mask and the positions (0, as on any left padding)."""
        extra = width - self.prompt_length
        if extra == 0:
            return self
        fill = {"pad_id": self.meta.get("pad_token_id", 0)}
        return self.with_fields(**{name: torch.nn.functional.pad(getattr(self, name), (extra, 0),
                                                                 value=fill.get(meta.get("pad"), 0))
                                   for name, meta in self._blocks().items() if meta["block"] == "full"})

    def prompt_groups(self) -> list[list[int]]:
        """Row indices of the rows with identical prompts (a prompt's samples), as `prompt_groups`."""
        return prompt_groups(self.input_ids, self.attention_mask, self.prompt_length)

    def deal(self, parts: int) -> list[list[int]]:
        """Row indices (ascending) in `parts` shares of near-equal real tokens: heaviest first, each
        to the lightest share. The rows of one prompt stay in one share (their forward shares the
        prompt) while there are at least `parts` prompts. Deterministic: every rank splits alike."""
        tokens = self.num_tokens().tolist()
        groups = self.prompt_groups()
        units = groups if len(groups) >= parts else [[i] for i in range(len(tokens))]
        weight = [sum(tokens[i] for i in unit) for unit in units]
        load = [0] * parts
        shares: list[list[int]] = [[] for _ in range(parts)]
        for u in sorted(range(len(units)), key=lambda u: (-weight[u], units[u][0])):
            target = min(range(parts), key=lambda k: (load[k], len(shares[k])))
            shares[target] += units[u]
            load[target] += weight[u]
        return [sorted(s) for s in shares]

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows `index`, in that order (tensor fields and per-row lists alike)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for name in self._row_fields():
            value = getattr(self, name)
            out[name] = value[idx] if isinstance(value, torch.Tensor) else [value[i] for i in idx.tolist()]
        return replace(self, **out, meta=dict(self.meta))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches, prompts left-padded and responses right-padded to the widest (replicas'
        prompt blocks differ where a multi-turn environment replaced some prompts)."""
        prompt_width = max(b.prompt_length for b in batches)
        width = max(b.response_length for b in batches)
        batches = [b.pad_prompts(prompt_width).pad_responses(width) for b in batches]
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
