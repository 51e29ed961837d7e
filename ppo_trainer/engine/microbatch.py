"""Mini-batch -> ranks -> micro-batches, and gradient accumulation that equals one big batch.

Token budget: a micro-batch's cost is what its forward actually computes, rows x padded width,
where the width is counted after `trim_padding` drops the columns that are padding in every row
of the micro-batch (max prompt length + max response length of its rows). Rows are packed
greedily, longest first, while rows x width <= `algorithm.ppo_micro_batch_tokens`; a row longer
than the budget gets a micro-batch of its own.

Loss normalisation: every micro-batch loss is aggregated with the token (or sequence) count of
the whole mini-batch summed over all data-parallel ranks (`GlobalCounts`), so the sum of the
micro-batch losses over micro-batches and ranks is the loss of the full mini-batch. FSDP2 averages
gradients over the data-parallel ranks (reduce-scatter divides by the world size); the loss is
therefore multiplied by the world size before `backward`, turning that average into the sum.
Gradients are synchronised only on the last micro-batch (`set_requires_gradient_sync`).

FSDP's collectives require every rank to run the same number of forwards: `plan_micro_batches`
agrees on the largest count over ranks, splits further where it can, and pads with dummy
micro-batches (a real row whose loss is multiplied by 0) where a rank has too few rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from ppo_trainer.batch import Batch
from ppo_trainer.engine.distributed import all_reduce_max, all_reduce_sum, world_size


@dataclass
class MicroBatch:
    """Rows of a (local) mini-batch, trimmed of shared padding.

    `rows` [b] indexes the batch the micro-batch was cut from; `dummy` marks a stand-in that only
    keeps this rank in step with the others (its loss is weighted 0, its outputs are discarded).
    """

    batch: Batch
    rows: torch.Tensor
    dummy: bool = False


@dataclass(frozen=True)
class GlobalCounts:
    """Valid response tokens and sequences of one mini-batch, summed over all ranks."""

    tokens: float
    seqs: float


LossFn = Callable[[Batch, GlobalCounts], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def row_extents(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] prompt lengths (real tokens of the left-padded prompt block) and [B] response lengths
    (up to the last real token of the right-padded response block)."""
    P, T = batch.prompt_length, batch.response_length
    prompt_real = batch.attention_mask[:, :P] != 0
    prompt_lens = (prompt_real * torch.arange(P, 0, -1)).amax(dim=1)
    response_real = batch.attention_mask[:, P:] != 0
    if batch.response_mask is not None:
        response_real = response_real | (batch.response_mask != 0)
    response_lens = (response_real * torch.arange(1, T + 1)).amax(dim=1) if T > 0 else torch.zeros_like(prompt_lens)
    return prompt_lens, response_lens


def _width(prompt_lens: torch.Tensor, response_lens: torch.Tensor) -> int:
    return int(prompt_lens.max()) + max(1, int(response_lens.max()))


def trim_padding(batch: Batch) -> Batch:
    """The same rows without the prompt columns that are padding in every row (on the left) and
    the response columns that are padding in every row (on the right; at least one is kept).

    Every [B, P+T] and [B, T] tensor field is cut accordingly; the prompt/response boundary stays
    the boundary, positions stay correct (position_ids travel with their tokens).
    """
    P, T = batch.prompt_length, batch.response_length
    prompt_lens, response_lens = row_extents(batch)
    keep_p = max(1, int(prompt_lens.max()))
    keep_t = max(1, int(response_lens.max())) if T > 0 else 0
    full_cols = slice(P - keep_p, P + keep_t)
    out = {}
    for name in batch._row_fields():
        value = getattr(batch, name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[1] == P + T:
                out[name] = value[:, full_cols]
            elif value.shape[1] == T:
                out[name] = value[:, :keep_t]
    return batch.with_fields(**out)


def split_by_token_budget(batch: Batch, budget: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: greedy, longest rows first, rows x width <= budget."""
    prompt_lens, response_lens = row_extents(batch)
    order = torch.argsort(prompt_lens + response_lens, descending=True, stable=True)
    groups: list[list[int]] = []
    current: list[int] = []
    max_p = max_r = 0
    for i in order.tolist():
        p, r = int(prompt_lens[i]), int(response_lens[i])
        new_p, new_r = max(max_p, p), max(max_r, r)
        if current and (len(current) + 1) * (new_p + max(1, new_r)) > budget:
            groups.append(current)
            current, new_p, new_r = [], p, r
        current.append(i)
        max_p, max_r = new_p, new_r
    if current:
        groups.append(current)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def deal_rows(batch: Batch, num_ranks: int) -> list[torch.Tensor]:
    """Row indices per rank, balancing real tokens: longest rows first, each to the rank with the
    fewest tokens so far. Deterministic, so every rank computes the same split."""
    if len(batch) < num_ranks:
        raise ValueError(
            f"a mini-batch of {len(batch)} sequences cannot feed {num_ranks} data-parallel ranks; "
            "every rank needs at least one (raise algorithm.ppo_mini_batch_size or use fewer devices)"
        )
    tokens = batch.num_tokens()
    order = torch.argsort(tokens, descending=True, stable=True)
    load = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order.tolist():
        r = min(range(num_ranks), key=lambda k: (load[k], len(shares[k]), k))
        shares[r].append(i)
        load[r] += int(tokens[i])
    return [torch.tensor(sorted(s), dtype=torch.long) for s in shares]


def plan_micro_batches(batch: Batch, budget: int) -> list[MicroBatch]:
    """Micro-batches of this rank's rows; the same number on every rank (a collective call).

    Groups from `split_by_token_budget` are halved (largest cost first) until this rank has as
    many as the rank that needs the most; a rank with fewer rows than that pads with dummies.
    """
    if len(batch) == 0:
        raise ValueError("a rank received no rows; every data-parallel rank needs at least one sequence")
    groups = split_by_token_budget(batch, budget)
    target = all_reduce_max(len(groups))
    prompt_lens, response_lens = row_extents(batch)

    def cost(rows: torch.Tensor) -> int:
        return len(rows) * _width(prompt_lens[rows], response_lens[rows])

    while len(groups) < target:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        largest = max(splittable, key=cost)
        groups.remove(largest)
        half = len(largest) // 2
        groups += [largest[:half], largest[half:]]
    micro = [MicroBatch(trim_padding(batch.select(rows)), rows) for rows in groups]
    while len(micro) < target:
        rows = groups[0][:1]
        micro.append(MicroBatch(trim_padding(batch.select(rows)), rows, dummy=True))
    return micro


def global_counts(batch: Batch) -> GlobalCounts:
    """Valid response tokens and rows of this rank's share of a mini-batch, summed over ranks."""
    tokens, seqs = all_reduce_sum([float(batch.response_mask.sum()), float(len(batch))]).tolist()
    return GlobalCounts(tokens=tokens, seqs=seqs)


def accumulate_gradients(
    model: FSDPModule, micro_batches: list[MicroBatch], loss_fn: LossFn, counts: GlobalCounts
) -> dict[str, float]:
    """Forward and backward every micro-batch; gradients hold the full mini-batch's afterwards.

    `loss_fn(micro_batch, counts)` returns the micro-batch's share of the mini-batch loss
    (aggregated with `counts`) and a dict of detached scalar shares of logged statistics, each
    normalised so that its sum over micro-batches and ranks is the mini-batch value. Returns those
    sums (over micro-batches and ranks). Dummy micro-batches contribute nothing.
    """
    scale = float(world_size())
    totals: dict[str, torch.Tensor] = {}
    for i, micro in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss, stats = loss_fn(micro.batch, counts)
        weight = 0.0 if micro.dummy else scale
        (loss * weight).backward()
        if not micro.dummy:
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value.detach().double().cpu()
    keys = sorted(totals)  # every rank has at least one real micro-batch, hence the same keys
    summed = all_reduce_sum(torch.stack([totals[k] for k in keys]))
    return dict(zip(keys, summed.tolist()))
