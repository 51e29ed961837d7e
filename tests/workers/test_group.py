"""WorkerGroup and Worker without a backend: how rows and seeds are dealt to replicas, what a worker sets up."""

from __future__ import annotations

import os
from typing import Any, Sequence

import pytest
import torch

from ppo_trainer.rollout import Sampler
from ppo_trainer.rollout.base import prompts_to_batch
from ppo_trainer.workers.group import WorkerGroup
from ppo_trainer.workers.process_tuning import CPU_KERNEL_CACHE_CAPACITY, CPU_KERNEL_CACHE_VARS


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
        group = WorkerGroup("rollout", workers)
        out = group.run_split(Sampler.generate, prompts(8), 2, seed=1234)
        torch.testing.assert_close(out, prompts(8).input_ids.float())  # rows come back in order
        seeds[replicas] = [args[-1] for args in workers.calls]
    assert seeds[1] == [1234]
    assert len(set(seeds[4])) == 4 and seeds[2] == seeds[4][:2]
    again = Recording(4)
    WorkerGroup("rollout", again).run_split(Sampler.generate, prompts(8), 2, seed=1234)
    assert [args[-1] for args in again.calls] == seeds[4]  # deterministic


class FakeEngine:
    """Records the calls a `Worker` passes on."""

    rank = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, *args))


def test_a_worker_calls_its_engine_and_owns_the_checkpoint_layout_and_rng(monkeypatch, tmp_path):
    from ppo_trainer.config.composition import compose
    from ppo_trainer.workers import roles
    from ppo_trainer.workers.cluster.nodes import write_marker

    monkeypatch.setitem(roles.BUILDERS, "actor", lambda cfg, device: FakeEngine())
    worker = roles.Worker("actor", compose(["trainer.seed=7"]), "cpu")
    assert torch.equal(worker.rng_state()["cpu"], torch.manual_seed(7).get_state())  # seeded per rank (0: the seed)
    worker.call("compute_logprobs", "rows")
    worker.call("update", "batch")
    worker.call("save", str(tmp_path), write_marker(tmp_path))
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


def test_a_worker_that_does_not_see_the_staged_folder_writes_nothing_and_names_its_host(monkeypatch, tmp_path):
    """The folder the driver staged holds its marker; a worker whose view differs (here: the marker
    is another run's) refuses the save before its engine writes anything."""
    import socket

    from ppo_trainer.config.composition import compose
    from ppo_trainer.workers import roles
    from ppo_trainer.workers.cluster import nodes as cluster
    from ppo_trainer.workers.cluster.nodes import MARKER, write_marker

    monkeypatch.setattr(cluster, "FOLDER_WAIT_S", 0.5)
    monkeypatch.setitem(roles.BUILDERS, "critic", lambda cfg, device: FakeEngine())
    worker = roles.Worker("critic", compose([]), "cpu")
    token = write_marker(tmp_path)
    (tmp_path / MARKER).write_text("another-token\n")
    with pytest.raises(roles.SharedFolderError) as e:
        worker.call("save", str(tmp_path), token)
    message = str(e.value)  # "host H does ..." here; "node IP [id] (host H) does ..." once a test started Ray
    assert socket.gethostname() in message.partition(" does not see")[0]
    assert f"does not see the folder {tmp_path} that the driver writes (it holds another run's marker)" in message
    assert worker.engine.calls == []


@pytest.mark.parametrize("device, keeps", [("cpu", True), ("cuda:0", False)])
def test_a_worker_computing_in_host_memory_keeps_freed_memory_before_its_engine_is_built(monkeypatch, device, keeps):
    from ppo_trainer.config.composition import compose
    from ppo_trainer.workers import roles

    events = []
    monkeypatch.setattr(roles, "keep_freed_host_memory", lambda: events.append("keep"))
    monkeypatch.setitem(roles.BUILDERS, "actor", lambda cfg, device: events.append("build") or FakeEngine())
    roles.Worker("actor", compose([]), device)
    assert events == (["keep", "build"] if keeps else ["build"])


def test_a_worker_caps_the_cpu_kernel_caches_before_its_engine_is_built_unless_the_user_set_them(monkeypatch):
    from ppo_trainer.config.composition import compose
    from ppo_trainer.workers import roles

    seen = {}

    def build(cfg, device):
        seen.update({var: os.environ.get(var) for var in CPU_KERNEL_CACHE_VARS})
        return FakeEngine()

    monkeypatch.setitem(roles.BUILDERS, "actor", build)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    roles.Worker("actor", compose([]), "cpu")
    assert seen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CPU_KERNEL_CACHE_CAPACITY), "LRU_CACHE_CAPACITY": "512"}
