"""`WorkerGroup`: the replicas of one role behind one API, local (one in this process) or Ray."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from omegaconf import DictConfig

from ppo_trainer.batch import Batch
from ppo_trainer.engine.distributed import init_one_rank
from ppo_trainer.workers import watchdog
from ppo_trainer.workers.accelerators import DeviceKind, detect
from ppo_trainer.workers.cluster.placement import roles_of
from ppo_trainer.workers.pending import Pending, ran
from ppo_trainer.workers.roles import Worker, method_name, replica_seed

R = TypeVar("R")


class LocalWorkers:
    """One `Worker` of `role` in this process; a call that outlives `timeout_s` ends the process
    (`watchdog.deadline`: exit 1 with every thread's stack)."""

    def __init__(self, worker: Optional[Worker], role: str, timeout_s: float):
        self.worker, self.role, self.timeout_s = worker, role, timeout_s

    def submit(self, method: str, args_per_replica: Sequence[tuple], kwargs: dict[str, Any]) -> Pending[list[Any]]:
        """The call runs now, to its end (`pending.ran`); its result or error waits in the handle."""
        (args,) = args_per_replica

        def overdue() -> str:
            return (f"the {self.role} worker's {method} did not return within trainer.worker_timeout_s="
                    f"{self.timeout_s:g} s; stopped (the stack of every thread follows on stderr, in engine.log "
                    "unless trainer.verbose)")

        def run() -> list[Any]:
            with watchdog.deadline(self.timeout_s, overdue):
                return [self.worker.call(method, *args, **kwargs)]

        return ran(run)

    def __len__(self) -> int:
        return 1

    def receivers(self) -> list[Worker]:
        """What `Worker.push_weights` hands weights to: the worker itself (same process)."""
        return [self.worker]

    def shutdown(self) -> None:
        self.worker = None


def merge_rows(results: Sequence[Any], parts: Sequence[Sequence[int]]) -> Any:
    """Per-replica results for `parts` rows back in the original order (tensors or Batches). A
    result may hold k adjacent rows per input row (n samples per prompt): row i -> i*k .. i*k+k-1."""
    kept = [r for r, part in zip(results, parts) if len(part)]
    if isinstance(kept[0], tuple):
        return tuple(merge_rows([r[i] for r in results], parts) for i in range(len(kept[0])))
    k = len(kept[0]) // len(next(p for p in parts if len(p)))
    order = torch.tensor([i * k + j for part in parts for i in part for j in range(k)], dtype=torch.long)
    inverse = torch.argsort(order)
    if isinstance(kept[0], Batch):
        return Batch.concat(kept).select(inverse)
    if kept[0].dim() > 1:  # [rows, T] trimmed to each replica's longest response: pad to the widest
        width = max(r.shape[1] for r in kept)
        kept = [torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in kept]
    return torch.cat(kept)[inverse]


class WorkerGroup:
    """The replicas of `role` ("actor", "critic", "rollout", "reward_model"): the seam between the driver
    and the workers. A caller names the method by reference, `group.run_all(ActorEngine.update, batch)`
    or `Worker.save`, checked against the role and its arguments (`roles.method_name`) before any
    worker runs. `workers`, the backend's handles on them (`LocalWorkers`, `ray_backend.RayWorkers`):
    `submit(name, args_per_replica, kwargs)` starts the method `name` on replica i with
    `args_per_replica[i]`, concurrently, and returns a `Pending` of the results by replica. Each
    `run_*` call is its `submit_*` call's result: `submit_*` lets the driver go on while the workers run."""

    def __init__(self, role: str, workers: Any):
        self.role, self.workers = role, workers

    def __len__(self) -> int:
        return len(self.workers)

    def receivers(self) -> list[Any]:
        """Handles through which another group's worker can call these replicas directly
        (`Worker.push_weights`): the Worker itself locally, the Ray actors on Ray."""
        return self.workers.receivers()

    def submit_all(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> Pending[list[R]]:
        """`run_all`, not waiting for the workers."""
        return self.workers.submit(method_name(self.role, method, args, kwargs), [args] * len(self.workers), kwargs)

    def submit_each(self, method: Callable[..., R], args_per_replica: Sequence[tuple]) -> Pending[list[R]]:
        """`run_each`, not waiting for the workers."""
        name = method_name(self.role, method, args_per_replica[0])
        return self.workers.submit(name, list(args_per_replica), {})

    def submit_split(self, method: Callable[..., R], batch: Batch, *args: Any, seed: Optional[int] = None,
                     **kwargs: Any) -> Pending[R]:
        """`run_split`, not waiting for the workers: the rows are dealt now, merged at `result()`."""
        replicas = len(self.workers)
        seeds = [()] * replicas if seed is None else [(replica_seed(seed, i),) for i in range(replicas)]
        name = method_name(self.role, method, (batch, *args, *seeds[0]), kwargs)
        if replicas == 1:
            return self.workers.submit(name, [(batch, *args, *seeds[0])], kwargs).then(lambda results: results[0])
        parts = batch.deal(replicas)
        shards = [(batch.select(part), *args, *seeds[i]) for i, part in enumerate(parts)]
        return self.workers.submit(name, shards, kwargs).then(lambda results: merge_rows(results, parts))

    def run_all(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """Every replica, same arguments (collectives: `update` takes the full batch on every rank)."""
        return self.submit_all(method, *args, **kwargs).result()

    def run_each(self, method: Callable[..., R], args_per_replica: Sequence[tuple]) -> list[R]:
        """Replica i gets `args_per_replica[i]` (e.g. its own saved state)."""
        return self.submit_each(method, args_per_replica).result()

    def run_split(self, method: Callable[..., R], batch: Batch, *args: Any, seed: Optional[int] = None,
                  **kwargs: Any) -> R:
        """Rows dealt across replicas by tokens, results in row order; replica i gets `replica_seed(seed, i)`."""
        return self.submit_split(method, batch, *args, seed=seed, **kwargs).result()

    def shutdown(self) -> None:
        self.workers.shutdown()


def device_count(groups: dict[str, WorkerGroup], colocate: bool, rollout_devices_per_replica: int = 1) -> int:
    """The devices a step's throughput is per: the actor's when the roles share them, else the
    actor's, the critic's (where the run built one) and the rollout's (a tensor-parallel replica
    holds `rollout_devices_per_replica`)."""
    roles = ("actor",) if colocate else ("actor", "critic", "rollout")
    return sum(len(groups[role]) * (rollout_devices_per_replica if role == "rollout" else 1)
               for role in roles if role in groups)


def build_groups(cfg: DictConfig, kind: Optional[DeviceKind] = None) -> dict[str, WorkerGroup]:
    """The groups of `roles_of(cfg)`, on `kind` (detected unless given). Local: built in that order in
    this process. Ray: all roles start concurrently."""
    kind = kind or detect(cfg.devices.accelerator)
    if cfg.devices.backend == "ray":
        from ppo_trainer.workers.cluster.backend import build_ray_groups

        return {role: WorkerGroup(role, workers) for role, workers in build_ray_groups(cfg, kind).items()}
    timeout = cfg.trainer.worker_timeout_s
    init_one_rank(torch.device(kind.torch_device_type))  # every role in this process: no peers to wait for
    groups = {}
    for role in roles_of(cfg):  # building counts as a call: loading a model can hang too (a stuck download)
        with watchdog.deadline(timeout, lambda: f"building the {role} worker took longer than "
                                                f"trainer.worker_timeout_s={timeout:g} s; stopped"):
            worker = Worker(role, cfg, kind.torch_device_type)
        groups[role] = WorkerGroup(role, LocalWorkers(worker, role, timeout))
    return groups
