"""WorkerGroup without a backend: how rows and seeds are dealt to replicas."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ppo_trainer.rollout.base import prompts_to_batch
from ppo_trainer.workers.group import WorkerGroup


class Recording:
    """Workers that return each replica's rows and remember the arguments each replica got."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.calls: list[tuple] = []

    def call(self, method: str, args_per_replica: Sequence[tuple], kwargs: dict[str, Any]) -> list[Any]:
        self.calls = list(args_per_replica)
        return [args[0].input_ids.float() for args in args_per_replica]

    def __len__(self) -> int:
        return self.replicas

    def shutdown(self) -> None:
        pass


def prompts(rows: int):
    return prompts_to_batch([[1 + i, 2, 3] for i in range(rows)], pad_id=0)


def test_each_replica_samples_with_its_own_seed_and_one_replica_keeps_the_seed():
    seeds = {}
    for replicas in (1, 2, 4):
        workers = Recording(replicas)
        group = WorkerGroup(workers)
        out = group.run_split("generate", prompts(8), 2, seed=1234)
        torch.testing.assert_close(out, prompts(8).input_ids.float())  # rows come back in order
        seeds[replicas] = [args[-1] for args in workers.calls]
    assert seeds[1] == [1234]
    assert len(set(seeds[4])) == 4 and seeds[2] == seeds[4][:2]
    again = Recording(4)
    WorkerGroup(again).run_split("generate", prompts(8), 2, seed=1234)
    assert [args[-1] for args in again.calls] == seeds[4]  # deterministic


class FakeEngine:
    """Records the calls a `Worker` passes on."""

    rank = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, *args))


def test_a_worker_calls_its_engine_and_owns_the_checkpoint_layout_rng_and_memory_trim(monkeypatch, tmp_path):
    from ppo_trainer.config import compose
    from ppo_trainer.workers import roles

    monkeypatch.setitem(roles.BUILDERS, "actor", lambda cfg, device: FakeEngine())
    trims = []
    monkeypatch.setattr(roles, "release_freed_host_memory", lambda: trims.append(1))
    worker = roles.Worker("actor", compose(["trainer.seed=7"]), "cpu")
    assert torch.equal(worker.rng_state()["cpu"], torch.manual_seed(7).get_state())  # seeded per rank (0: the seed)
    worker.call("compute_logprobs", "rows")
    worker.call("update", "batch")
    assert trims == [1, 1], "host memory is trimmed after every call (scoring and update alike)"
    worker.call("save", str(tmp_path))
    worker.call("load", str(tmp_path))
    assert worker.engine.calls == [
        ("compute_logprobs", "rows"), ("update", "batch"),
        ("save_hf", tmp_path / "actor", tmp_path / "actor_merged"), ("save_state", tmp_path / "state" / "actor"),
        ("load_state", tmp_path / "state" / "actor"),
    ]
    state = worker.call("rng_state")
    torch.rand(3)
    worker.call("set_rng_state", state)
    assert torch.equal(torch.get_rng_state(), state["cpu"])
