"""PromptLoader: full seeded batches, epoch reshuffles, exact save and restore of the position."""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer.data import PromptLoader, PromptRecord


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(i, f"q{i}", f"p{i}", (i,), str(i)) for i in range(n)]


def _indices(loader: PromptLoader, steps: int) -> list[list[int]]:
    return [[r.index for r in next(loader)] for _ in range(steps)]


def test_every_epoch_visits_every_record_once() -> None:
    loader = PromptLoader(_records(12), batch_size=4, seed=0)
    batches = _indices(loader, 6)
    assert all(len(b) == 4 for b in batches)
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second  # reshuffled per epoch
    assert loader.state_dict() == {"epoch": 1, "position": 12}


def test_batches_cross_epoch_boundaries_and_stay_full() -> None:
    loader = PromptLoader(_records(5), batch_size=3, seed=1)
    flat = sum(_indices(loader, 5), [])
    assert len(flat) == 15 and Counter(flat) == Counter({i: 3 for i in range(5)})
    assert loader.state_dict() == {"epoch": 2, "position": 5}


def test_same_seed_same_order_other_seed_other_order() -> None:
    a = _indices(PromptLoader(_records(50), 10, seed=7), 10)
    b = _indices(PromptLoader(_records(50), 10, seed=7), 10)
    c = _indices(PromptLoader(_records(50), 10, seed=8), 10)
    assert a == b and a != c


def test_without_shuffle_the_dataset_order_repeats() -> None:
    loader = PromptLoader(_records(4), batch_size=3, seed=0, shuffle=False)
    assert _indices(loader, 4) == [[0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3]]


def test_batch_larger_than_the_dataset_spans_epochs() -> None:
    loader = PromptLoader(_records(2), batch_size=5, seed=0)
    assert sorted(_indices(loader, 1)[0]) == [0, 0, 0, 1, 1]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30), batch_size=st.integers(1, 12), seed=st.integers(0, 2**31),
    before=st.integers(0, 20), after=st.integers(1, 10), shuffle=st.booleans(),
)
def test_restored_loader_continues_identically(
    n: int, batch_size: int, seed: int, before: int, after: int, shuffle: bool
) -> None:
    records = _records(n)
    original = PromptLoader(records, batch_size, seed, shuffle)
    _indices(original, before)
    state = json.loads(json.dumps(original.state_dict()))  # as written into a checkpoint
    restored = PromptLoader(records, batch_size, seed, shuffle)
    restored.load_state_dict(state)
    assert _indices(restored, after) == _indices(original, after)
