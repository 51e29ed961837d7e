"""`core.groups`: which prompt groups have any spread (hand-computed, exact in float64), and their rows."""

from __future__ import annotations

import torch

from ppo_trainer.core.groups import group_rows, groups_with_spread


def test_groups_of_two_spread_only_where_the_two_differ():
    scores = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.5, -1.0, 1.0], dtype=torch.float64)
    assert groups_with_spread(scores, 2).tolist() == [False, True, False, True]


def test_groups_of_four_spread_when_one_sample_differs():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0,  1.0, 1.0, 0.0, 1.0,  0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    assert groups_with_spread(scores, 4).tolist() == [False, True, False]


def test_the_smallest_float64_difference_counts_as_spread():
    one = torch.tensor(1.0, dtype=torch.float64)
    scores = torch.stack([one, torch.nextafter(one, torch.tensor(2.0, dtype=torch.float64))])
    assert groups_with_spread(scores, 2).tolist() == [True]


def test_group_rows_are_each_groups_adjacent_samples_in_group_order():
    assert group_rows(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert group_rows(torch.tensor([], dtype=torch.long), 2).tolist() == []
