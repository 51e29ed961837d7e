"""PromptLoader: full seeded batches, epoch reshuffles, files mixed by weight, exact save and
restore of the position."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer.data import PromptLoader, PromptRecord


def _records(n: int, origin: str = "") -> list[PromptRecord]:
    return [PromptRecord(i, f"q{i}", f"p{i}", (i,), str(i), origin or "gen", origin=origin) for i in range(n)]


def _indices(loader: PromptLoader, steps: int) -> list[list[int]]:
    return [[r.index for r in next(loader)] for _ in range(steps)]


def test_every_epoch_visits_every_record_once() -> None:
    loader = PromptLoader(_records(12), batch_size=4, seed=0)
    batches = _indices(loader, 6)
    assert all(len(b) == 4 for b in batches)
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second  # reshuffled per epoch
    assert loader.state_dict()["parts"] == [{"epoch": 1, "position": 12}]


def test_batches_cross_epoch_boundaries_and_stay_full() -> None:
    loader = PromptLoader(_records(5), batch_size=3, seed=1)
    flat = sum(_indices(loader, 5), [])
    assert len(flat) == 15 and Counter(flat) == Counter({i: 3 for i in range(5)})
    assert loader.state_dict()["parts"] == [{"epoch": 2, "position": 5}]


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


def test_one_file_keeps_the_order_of_a_loader_before_mixing() -> None:
    """Epoch e of a single part is permutation(default_rng([seed, e])), as before files were mixed:
    a one-file or generator run trains on the same batches as it did."""
    loader = PromptLoader(_records(7), batch_size=7, seed=3)
    expected = [np.random.default_rng([3, epoch]).permutation(7).tolist() for epoch in range(3)]
    assert _indices(loader, 3) == expected


def _mixed(a: int, b: int, weights=None, batch_size: int = 8, seed: int = 0) -> PromptLoader:
    return PromptLoader(_records(a, "a.jsonl") + _records(b, "b.parquet"), batch_size, seed, weights=weights)


def _origins(loader: PromptLoader, steps: int) -> list[str]:
    return [r.origin for _ in range(steps) for r in next(loader)]


def test_two_files_mix_by_weight_each_with_its_own_epochs() -> None:
    loader = _mixed(10, 1000, weights=[3, 1])
    drawn = _origins(loader, 500)
    share = drawn.count("a.jsonl") / len(drawn)
    assert abs(share - 0.75) < 0.02  # 4000 draws: the standard error is 0.007
    state = loader.state_dict()["parts"]
    assert state[0]["epoch"] * 10 + state[0]["position"] == drawn.count("a.jsonl")
    assert state[1] == {"epoch": 0, "position": drawn.count("b.parquet")}  # 1000 records: still in epoch 0


def test_files_are_weighted_by_their_size_by_default() -> None:
    drawn = _origins(_mixed(100, 300), 500)
    assert abs(drawn.count("a.jsonl") / len(drawn) - 0.25) < 0.02


def test_each_file_visits_all_its_records_once_per_epoch_in_its_own_order() -> None:
    loader = _mixed(6, 6, weights=[1, 1], batch_size=4)
    by_origin: dict[str, list[int]] = {"a.jsonl": [], "b.parquet": []}
    while min(len(v) for v in by_origin.values()) < 12:
        for r in next(loader):
            by_origin[r.origin].append(r.index)
    a, b = (by_origin[o][:12] for o in ("a.jsonl", "b.parquet"))
    assert sorted(a[:6]) == sorted(a[6:]) == sorted(b[:6]) == list(range(6))
    assert a[:6] != b[:6]  # the second file's permutation is drawn from (seed, epoch, 1)


def test_weights_must_match_the_files() -> None:
    with pytest.raises(ValueError, match=r"data.train_weights has 3 weights for 2 train files \(a.jsonl, b.parquet\)"):
        _mixed(2, 2, weights=[1, 1, 1])


def test_a_state_from_before_mixing_resumes_a_one_file_loader() -> None:
    original = PromptLoader(_records(9), batch_size=4, seed=2)
    _indices(original, 3)
    old_style = original.state_dict()["parts"][0]  # {"epoch", "position"}: what checkpoints held
    restored = PromptLoader(_records(9), batch_size=4, seed=2)
    restored.load_state_dict(old_style)
    assert _indices(restored, 4) == _indices(original, 4)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=2, max_size=3), batch_size=st.integers(1, 9),
    seed=st.integers(0, 2**31), before=st.integers(0, 15), after=st.integers(1, 8), shuffle=st.booleans(),
    weighted=st.booleans(),
)
def test_restored_mixing_loader_continues_identically(
    sizes: list[int], batch_size: int, seed: int, before: int, after: int, shuffle: bool, weighted: bool
) -> None:
    records = [r for k, n in enumerate(sizes) for r in _records(n, f"file{k}.jsonl")]
    weights = [k + 1.5 for k in range(len(sizes))] if weighted else None

    def loader() -> PromptLoader:
        return PromptLoader(records, batch_size, seed, shuffle, weights=weights)

    original = loader()
    [next(original) for _ in range(before)]
    state = json.loads(json.dumps(original.state_dict()))  # as written into a checkpoint
    restored = loader()
    restored.load_state_dict(state)
    for _ in range(after):
        assert [(r.origin, r.index) for r in next(restored)] == [(r.origin, r.index) for r in next(original)]


def test_a_state_that_does_not_fit_the_files_is_refused() -> None:
    state = _mixed(3, 3).state_dict()
    with pytest.raises(ValueError, match=r"does not fit train data of 1 part\(s\) with \[6\] records"):
        PromptLoader(_records(6), 2, 0).load_state_dict(state)
