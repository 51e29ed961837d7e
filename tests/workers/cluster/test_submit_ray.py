"""`RayWorkers.submit` on the session's Ray cluster, over two plain Ray actors standing in for the
`WorkerHost`s (no model): it returns while the ranks still run, `result()` gives what the blocking
path gives, and a failure or a call past trainer.worker_timeout_s (counted from the submit) fails at
`result()` with the blocking path's errors."""

from __future__ import annotations

import time

import pytest

from ppo_trainer.workers.roles import WorkerError

ray = pytest.importorskip("ray")


def ray_workers(ray_cluster: str, timeout_s: float):
    """A `RayWorkers` of the critic role whose hosts are two actors with `call(method, seconds)`: rank r
    sleeps `seconds` and returns (method, r); method "update" raises on rank 1."""
    from ppo_trainer.workers.cluster.backend import RayWorkers

    class Host:  # nested: cloudpickle ships it by value into the actor
        def __init__(self, rank: int):
            self.rank = rank

        def call(self, method: str, seconds: float) -> tuple[str, int]:
            import time

            time.sleep(seconds)
            if method == "update" and self.rank == 1:
                raise ValueError("a broken batch")
            return method, self.rank

    if not ray.is_initialized():
        ray.init(address=ray_cluster)  # the fixture bound Ray to loopback
    workers = RayWorkers.__new__(RayWorkers)  # its submit and _gather over the stand-ins
    workers.role, workers.timeout_s, workers.failure = "critic", 60.0, None
    workers.distributed, workers.grouped, workers.pool = False, False, None
    workers.hosts = [ray.remote(Host).options(num_cpus=0).remote(rank) for rank in range(2)]
    # both processes up before the clock matters: on a busy machine starting one takes seconds
    assert workers.submit("ready", [(0.0,), (0.0,)], {}).result() == [("ready", 0), ("ready", 1)]
    workers.timeout_s = timeout_s
    return workers


@pytest.fixture
def workers(ray_cluster):
    made = []

    def make(timeout_s: float = 60.0):
        made.append(ray_workers(ray_cluster, timeout_s))
        return made[-1]

    yield make
    for w in made:
        w.shutdown()


def test_submit_returns_while_the_ranks_run_and_result_gives_the_results_by_rank(workers):
    group = workers()
    start = time.monotonic()
    pending = group.submit("compute_values", [(2.0,), (0.0,)], {})
    assert time.monotonic() - start < 1.5
    assert pending.result() == [("compute_values", 0), ("compute_values", 1)]
    assert time.monotonic() - start >= 2.0


def test_a_failing_rank_fails_at_result_with_the_blocking_paths_error(workers):
    pending = workers().submit("update", [(0.0,), (0.0,)], {})
    with pytest.raises(WorkerError, match=r"^critic worker rank 1 of 2 failed in update: ValueError: a broken batch$"):
        pending.result()


def test_the_worker_timeout_counts_from_the_submit(workers):
    """The driver's own work after a submit counts: a result asked for past the deadline fails at once."""
    group = workers(timeout_s=2.0)
    pending = group.submit("compute_values", [(0.0,), (60.0,)], {})
    time.sleep(2.5)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"critic worker rank 1 of 2 did not return from compute_values within "
                                          r"trainer.worker_timeout_s=2 s; its workers were stopped"):
        pending.result()
    assert time.monotonic() - start < 1.0
