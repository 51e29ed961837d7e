"""`PromptLoader`: seeded, endless batches of prompts mixed from one or more files, whose position
can be saved and restored."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ppo_trainer.data.datasets import PromptRecord


class PromptLoader:
    """Yields `batch_size` records per PPO step, forever. The records form parts by `origin` (a
    train file, or the one generator or hub split), in order of appearance. Each part has its own
    epochs: an epoch visits every record of the part once, in an order drawn from (seed, epoch)
    for the first part and (seed, epoch, part) for the others when `shuffle`, and a part that runs
    out starts its next epoch. With several parts each slot of a batch draws its part with
    probability `weights[part]` (normalised; None: the parts' sizes) from a generator seeded once
    with `seed`. A loader restored from `state_dict()` yields what the original would."""

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int, shuffle: bool = True,
                 weights: Optional[Sequence[float]] = None) -> None:
        if not records:
            raise ValueError("PromptLoader needs at least one record")
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        origins = list(dict.fromkeys(r.origin for r in records))
        self.parts = [[r for r in records if r.origin == origin] for origin in origins]
        sizes = [len(part) for part in self.parts]
        if weights is not None and len(weights) != len(self.parts):
            raise ValueError(f"data.train_weights has {len(weights)} weights for {len(self.parts)} train files "
                             f"({', '.join(origins)}); give one per file")
        chosen = np.asarray(sizes if weights is None else weights, dtype=np.float64)
        self.weights = chosen / chosen.sum()  # [parts] the probability that a slot comes from each part
        self._orders: list[np.ndarray] = []
        self.load_state_dict({"parts": [{"epoch": 0, "position": 0} for _ in self.parts],
                              "draw": np.random.default_rng(seed).bit_generator.state})


    @classmethod
    def from_config(cls, cfg: Any, records: Sequence[PromptRecord]) -> "PromptLoader":
        """A run's training batches: `data.train_batch_size` prompts a step, seeded by `trainer.seed`,
        files mixed by `data.train_weights`."""
        d = cfg.data
        return cls(records, d.train_batch_size, cfg.trainer.seed, d.shuffle, weights=list(d.train_weights) or None)
    def __next__(self) -> list[PromptRecord]:
        if len(self.parts) == 1:
            picks = [0] * self.batch_size
        else:
            picks = self._draw.choice(len(self.parts), size=self.batch_size, p=self.weights).tolist()
        return [self._take(part) for part in picks]

    def _take(self, part: int) -> PromptRecord:
        """The next record of `part`, starting its next epoch when the current one is used up."""
        if self.positions[part] == len(self.parts[part]):
            self._start_epoch(part, self.epochs[part] + 1, 0)
        record = self.parts[part][self._orders[part][self.positions[part]]]
        self.positions[part] += 1
        return record

    def _start_epoch(self, part: int, epoch: int, position: int) -> None:
        self.epochs[part], self.positions[part] = epoch, position
        n = len(self.parts[part])
        key = [self.seed, epoch] if part == 0 else [self.seed, epoch, part]  # part 0: a one-file run's order
        # [n] indices into the part, in this epoch's order
        self._orders[part] = np.random.default_rng(key).permutation(n) if self.shuffle else np.arange(n)

    def state_dict(self) -> dict[str, Any]:
        """{"parts": [{"epoch", "position"} of each part], "draw": the part-drawing generator's state}:
        where the next batch starts (JSON-serialisable)."""
        return {"parts": [{"epoch": e, "position": p} for e, p in zip(self.epochs, self.positions)],
                "draw": self._draw.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` of a loader over the same records, seed, shuffle and weights
        (also the {"epoch", "position"} of a one-part loader, as checkpoints before mixing saved it).
        ValueError if the state does not fit these records."""
        if "parts" not in state and len(self.parts) == 1:
            state = {"parts": [state], "draw": np.random.default_rng(self.seed).bit_generator.state}
        parts = state.get("parts", [])
        sizes = [len(part) for part in self.parts]
        fits = "draw" in state and len(parts) == len(sizes) and all(
            int(p["epoch"]) >= 0 and 0 <= int(p["position"]) <= size for p, size in zip(parts, sizes))
        if not fits:
            raise ValueError(f"loader state {parts} does not fit train data of {len(sizes)} part(s) with "
                             f"{sizes} records")
        self.epochs, self.positions = [0] * len(sizes), [0] * len(sizes)
        self._orders = [np.arange(0)] * len(sizes)
        for part, saved in enumerate(parts):
            self._start_epoch(part, int(saved["epoch"]), int(saved["position"]))
        self._draw = np.random.default_rng()
        self._draw.bit_generator.state = state["draw"]
