"""DAPO's dynamic sampling (algorithm.filter_groups): a step's groups whose samples all score the
same are dropped and more prompts are drawn until the batch holds data.train_batch_size prompts'
groups; at algorithm.filter_groups_max_draws draws the last draw's groups fill the rest, spread or
not, so the step always trains (a random model may never score differently)."""

from __future__ import annotations

from typing import Callable

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.core.groups import group_rows, groups_with_spread
from ppo_trainer.data import PromptRecord

Draw = tuple[list[PromptRecord], Batch]  # a draw's prompt records and its rollout, scored


def fill_groups(first: Draw, draw: Callable[[int], Draw], measure: Callable[[Batch], torch.Tensor], *,
                n: int, prompts: int, max_draws: int) -> tuple[Draw, dict[str, float]]:
    """Keep the groups with spread from `first` and from `draw(1)`, `draw(2)`, ... (each `prompts`
    prompts' rollouts, scored) until `prompts` groups are kept or `max_draws` draws are made; then
    the last draw's other groups, in order, fill the rest. `measure(batch)`: [B] float64, the values
    whose spread counts. Returns the kept records and rows (kept order: draw by draw, prompt order
    within a draw) and filter/kept_groups (with spread), filter/draws, filter/filled_groups."""
    records: list[PromptRecord] = []
    batches: list[Batch] = []
    current, draws = first, 1
    while True:
        recs, batch = current
        spread = groups_with_spread(measure(batch), n)
        keep = spread.nonzero().reshape(-1)[:prompts - len(records)]
        kept = len(records) + len(keep)
        if kept < prompts and draws >= max_draws:  # the cap: fill from this draw, regardless of spread
            keep = torch.sort(torch.cat([keep, (~spread).nonzero().reshape(-1)[:prompts - kept]])).values
        records += [recs[i] for i in keep.tolist()]
        if len(keep):
            batches.append(batch.select(group_rows(keep, n)))
        if len(records) == prompts:
            metrics = {"filter/kept_groups": float(kept), "filter/draws": float(draws),
                       "filter/filled_groups": float(prompts - kept)}
            return (records, Batch.concat(batches)), metrics
        current, draws = draw(draws), draws + 1
