"""Micro-batches within a token budget (`algorithm.ppo_micro_batch_tokens`: the tokens a forward computes,
padded, by prompt or packed, `micro_batch_units`), and
gradient accumulation that equals one big batch: each micro-batch loss is aggregated with the whole
mini-batch's counts over all ranks (`GlobalCounts`), so the losses sum to the mini-batch loss; FSDP2
averages gradients over ranks, so the loss is multiplied by the world size before `backward`. FSDP's
collectives need the same number of forwards on every rank: short ranks pad with dummies (loss x 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.engine.distributed import all_reduce_max, all_reduce_sum, world_size
from ppo_trainer.models.packing import Layout, block_rows


@dataclass
class MicroBatch:
    """Rows `rows` [b] of a local mini-batch, trimmed of shared padding; `dummy`: a stand-in that
    keeps this rank in step with the others (loss weighted 0, outputs discarded). `tokens`: what its
    forward computes (`micro_batch_units`), `padding` of them."""

    batch: Batch
    rows: torch.Tensor
    dummy: bool = False
    tokens: int = 0
    padding: int = 0


@dataclass(frozen=True)
class GlobalCounts:
    """Valid response tokens and sequences of one mini-batch, and the valid tokens of its rows marked
    `Batch.positive` (0 without the field), summed over all ranks."""

    tokens: float
    seqs: float
    positive_tokens: float = 0.0


# (micro-batch, mini-batch counts) -> (loss share, statistics' shares)
LossFn = Callable[[Batch, GlobalCounts], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Costs(NamedTuple):
    """`units`: the row groups a split keeps whole; `cost(rows)`: the tokens a forward over those rows
    computes; `needed(rows)`: the tokens of their blocks, what the forward would compute without padding."""

    units: list[list[int]]
    cost: Callable[[list[int]], int]
    needed: Callable[[list[int]], int]


def micro_batch_units(batch: Batch, layout: Layout) -> Costs:
    """The `Costs` of `batch`'s rows as `models.packing` lays them out. Units: rows, or where the
    layout shares prompts the rows of one prompt. Blocks: a prompt and its rows' responses, or one
    row's sequence. Cost: padded, rows x trimmed width (longest prompt + longest response, at least
    1), as without packing when no prompt repeats; otherwise rows of blocks x the longest block, one
    block per row or, packed, first-fit decreasing (`block_rows`)."""
    prompt_lens, response_lens = (x.tolist() for x in batch.row_extents())
    units = batch.prompt_groups() if layout.share_prompts else [[i] for i in range(len(batch))]
    unit_of = {row: u for u, rows in enumerate(units) for row in rows}

    def block_lengths(rows: list[int]) -> list[int]:
        blocks: dict[int, int] = {}
        for i in rows:
            blocks[unit_of[i]] = blocks.get(unit_of[i], prompt_lens[i]) + response_lens[i]
        return list(blocks.values())

    def cost(rows: list[int]) -> int:
        lengths = block_lengths(rows)
        if not layout.pack and len(lengths) == len(rows):  # a block per row: the padded rows run as they are
            return len(rows) * (max(prompt_lens[i] for i in rows) + max(1, *(response_lens[i] for i in rows)))
        return len(block_rows(lengths, layout.pack)) * max(lengths)

    return Costs(units, cost, lambda rows: sum(block_lengths(rows)))


def fill_by_cost(units: list[list[int]], cost: Callable[[list[int]], int], budget: int) -> list[list[int]]:
    """Row indices of each micro-batch: greedy, costliest units first, cost <= budget (a unit over
    budget alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for unit in sorted(units, key=lambda unit: -cost(unit)):  # stable: ties keep row order
        if current and cost(current + unit) > budget:
            groups.append(current)
            current = []
        current = current + unit
    if current:
        groups.append(current)
    return groups


def plan_micro_batches(batch: Batch, budget: int, layout: Layout = Layout()) -> list[MicroBatch]:
    """Micro-batches of this rank's rows within `budget` tokens (`micro_batch_units`, `fill_by_cost`),
    as many as the rank that needs the most (a collective call): the costliest groups are halved,
    and a rank with too few rows pads with dummies."""
    if len(batch) == 0:
        raise ValueError("a rank received no rows; every data-parallel rank needs at least one sequence")
    units, cost, needed = micro_batch_units(batch, layout)
    groups = fill_by_cost(units, cost, budget)
    target = all_reduce_max(len(groups))
    while len(groups) < target:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        largest = max(splittable, key=cost)
        groups.remove(largest)
        half = len(largest) // 2
        groups += [largest[:half], largest[half:]]
    micro = [MicroBatch(batch.select(rows).trim_padding(), torch.tensor(rows), tokens=tokens, padding=tokens - needed(rows))
             for rows, tokens in ((rows, cost(rows)) for rows in groups)]
    while len(micro) < target:
        rows = groups[0][:1]
        micro.append(MicroBatch(batch.select(rows).trim_padding(), torch.tensor(rows), dummy=True))
    return micro


def global_counts(batch: Batch) -> GlobalCounts:
    """Valid response tokens, rows and positive rows' tokens of this rank's share of a mini-batch,
    summed over ranks."""
    positive = 0.0 if batch.positive is None else float(batch.response_mask[batch.positive.bool()].sum())
    tokens, seqs, positive = all_reduce_sum([float(batch.response_mask.sum()), float(len(batch)), positive]).tolist()
    return GlobalCounts(tokens=tokens, seqs=seqs, positive_tokens=positive)


def accumulate_gradients(micro_batches: list[MicroBatch], loss_fn: LossFn, counts: GlobalCounts) -> dict[str, float]:
    """Forward and backward every micro-batch, so `.grad` holds the full mini-batch's gradient.
    `loss_fn(micro_batch, counts)` returns its share of the mini-batch loss and detached
    shares of logged statistics; returns those shares summed over micro-batches and ranks (dummies excluded).

    Every backward reduce-scatters into the sharded float32 gradient: skipping the sync until the
    last micro-batch would hold a whole unsharded float32 gradient on every rank (the model's full
    size, +0.5 GiB for the 135M critic on one CPU), which is what sharding is there to avoid."""
    scale = float(world_size())
    totals: dict[str, torch.Tensor] = {}
    for micro in micro_batches:
        loss, stats = loss_fn(micro.batch, counts)
        weight = 0.0 if micro.dummy else scale
        (loss * weight).backward()
        if not micro.dummy:
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value.detach().double().cpu()
    keys = sorted(totals)  # every rank has at least one real micro-batch, hence the same keys
    summed = all_reduce_sum(torch.stack([totals[k] for k in keys]))
    return dict(zip(keys, summed.tolist()))
