"""WorkerGroup and Worker without Ray: how rows and seeds are dealt to replicas, what submitting a call
leaves for `result()` on the local backend, what a worker sets up."""

from __future__ import annotations

import os
from typing import Any, Sequence

import pytest
import torch

from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.rollout import Sampler
from ppo_trainer.rollout.base import prompts_to_batch
from ppo_trainer.workers.group import LocalWorkers, WorkerGroup, device_count
from ppo_trainer.workers.pending import Pending, ran
from ppo_trainer.workers.process_tuning import CPU_KERNEL_CACHE_CAPACITY, CPU_KERNEL_CACHE_VARS


class Recording:
    """Workers that return each replica's rows and remember the arguments each replica got."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.calls: list[tuple] = []

    def submit(self, method: str, args_per_replica: Sequence[tuple], kwargs: dict[str, Any]) -> Pending[list[Any]]:
        self.calls = list(args_per_replica)
        return ran(lambda: [args[0].input_ids.float() for args in args_per_replica])

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


def test_throughput_is_per_device_a_tensor_parallel_replica_counting_its_devices():
    groups = {role: WorkerGroup(role, [None] * n) for role, n in (("actor", 4), ("critic", 2), ("rollout", 1))}
    assert device_count(groups, colocate=False) == 7
    assert device_count(groups, colocate=False, rollout_devices_per_replica=2) == 8
    assert device_count(groups, colocate=True, rollout_devices_per_replica=2) == 4  # the actor's devices


def test_a_submitted_split_gives_the_blocking_calls_rows_and_merges_them_at_result():
    for replicas in (1, 3):
        blocking = WorkerGroup("rollout", Recording(replicas)).run_split(Sampler.generate, prompts(7), 2, seed=5)
        workers = Recording(replicas)
        pending = WorkerGroup("rollout", workers).submit_split(Sampler.generate, prompts(7), 2, seed=5)
        assert len(workers.calls) == replicas  # dealt and sent at submit
        torch.testing.assert_close(pending.result(), blocking)


class Rows:
    """A local worker that answers `compute_logprobs` with its rows' ids and records every call in order."""

    def __init__(self):
        self.log: list[str] = []

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.log.append(method)
        if method == "update":
            raise ValueError("a broken batch")
        return args[0].input_ids.float() if args else method


def local_actor() -> tuple[WorkerGroup, Rows]:
    worker = Rows()
    return WorkerGroup("actor", LocalWorkers(worker, "actor", timeout_s=60.0)), worker


def test_the_local_backends_submitted_calls_give_the_blocking_calls_results():
    group, _ = local_actor()
    torch.testing.assert_close(group.submit_split(ActorEngine.compute_logprobs, prompts(3)).result(),
                               group.run_split(ActorEngine.compute_logprobs, prompts(3)))
    assert group.submit_all(ActorEngine.full_state_dict).result() == group.run_all(ActorEngine.full_state_dict)
    assert group.submit_each(ActorEngine.full_state_dict, [()]).result() == ["full_state_dict"]


def test_the_local_backend_runs_a_call_at_submit_in_order_and_raises_its_error_at_result():
    """As a Ray actor runs its calls in the order they came, whenever the driver asks for the results."""
    group, worker = local_actor()
    failed = group.submit_all(ActorEngine.update, prompts(2))
    later = group.submit_all(ActorEngine.full_state_dict)
    assert worker.log == ["update", "full_state_dict"]
    assert later.result() == ["full_state_dict"]
    with pytest.raises(ValueError, match="a broken batch"):
        failed.result()


def test_a_method_the_role_does_not_run_fails_at_submit_before_any_worker_runs():
    group, worker = local_actor()
    with pytest.raises(TypeError, match="is not a method the actor workers run"):
        group.submit_split(Sampler.generate, prompts(2), 1)
    assert worker.log == []


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


def test_a_workers_busy_time_counts_calls_side_by_side_once_and_a_running_call_up_to_now(monkeypatch):
    """Partial rollouts' rollout worker runs a weight push beside a generation: the idle share must
    see one busy stretch. A generation runs from 1 to 6, a push from 2 to 3; read at 4, 10 and 12."""
    from ppo_trainer.workers import roles

    now = [0.0]
    monkeypatch.setattr(roles.time, "perf_counter", lambda: now[0])
    clock = roles.BusyClock()
    read = []
    for t, calls in ((1, +1), (2, +1), (3, -1), (4, None), (6, -1), (10, None), (12, None)):
        now[0] = t
        if calls is None:
            read.append(clock.take())
        else:
            clock.change(calls)
    assert read == [3.0, 2.0, 0.0]
