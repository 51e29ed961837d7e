"""`PromptLoader`: seeded, endless batches of prompts whose position can be saved and restored."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ppo_trainer.data.datasets import PromptRecord


class PromptLoader:
    """Yields `batch_size` records per PPO step, forever; each epoch visits every record once, in
    an order drawn from (seed, epoch) when `shuffle`; a batch crossing an epoch's end continues
    into the next. A loader restored from `state_dict()` yields what the original would."""

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not records:
            raise ValueError("PromptLoader needs at least one record")
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        self.load_state_dict({"epoch": 0, "position": 0})  # position: records of the epoch already yielded

    def __next__(self) -> list[PromptRecord]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.records):
                self.load_state_dict({"epoch": self.epoch + 1, "position": 0})
            take = min(self.batch_size - len(batch), len(self.records) - self.position)
            batch.extend(self.records[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "position"}: where the next batch starts."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` of a loader over the same records, seed and shuffle."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= len(self.records) or epoch < 0:
            raise ValueError(f"loader state {state} does not fit a dataset of {len(self.records)} records")
        self.epoch, self.position = epoch, position
        n = len(self.records)
        # [N] record indices in this epoch's order
        self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
