"""The Ray backend of `WorkerGroup`: one Ray actor per rank, in one placement group per pool
(one bundle per device, or per tensor-parallel rollout replica of k devices, pinned to the Ray node
`fit_on_cluster` chose before anything is created).
Before any model loads, every worker reports its node (`cluster.node_report`: versions, the output
folder, the model) and the distributed roles join their process groups (`WorkerHost.join_group`)."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
import ray._private.ray_constants as ray_constants
import torch
from omegaconf import DictConfig, OmegaConf
from ray._private.state import available_resources_per_node
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_trainer.engine.distributed import join_group, open_store_listener, resolve_device
from ppo_trainer.workers.accelerators import DeviceKind, detect
from ppo_trainer.workers.cluster.network import choose_gloo_interface
from ppo_trainer.workers.cluster.nodes import (
    NodeReport,
    check_reports,
    model_paths,
    node_report,
    package_versions,
    packages_for,
    remove_marker,
    write_marker,
)
from ppo_trainer.workers.cluster.placement import (
    DISTRIBUTED_ROLES,
    ClusterNode,
    Placement,
    PlacementError,
    Pool,
    RolePlacement,
    assign_nodes,
    bundle_spec,
    format_resources,
    plan_placement,
    ray_init_kwargs,
    worker_resources,
)
from ppo_trainer.workers.pending import Pending
from ppo_trainer.workers.roles import WorkerError

log = logging.getLogger("ppo_trainer")

PLACEMENT_TIMEOUT_S = 60.0  # a placement group that fits on paper but is not ready by then fails
FIT_SETTLE_S = 5.0  # resources freed moments ago (a group just shut down) are reported late
FAILURE_GRACE_S = 3.0  # after a first failure, how long to wait for the failing worker's own report
# Errors a rank reports when a peer of its process group went away: never the root cause.
PEER_ERROR_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                      "remote process exited", "socket closed")
# How gloo, NCCL and the TCP store say that a collective or the rendezvous ran out of time.
TIMEOUT_MARKERS = ("timed out", "timeout")


def bind_loopback() -> None:
    """Make a Ray started by this process bind 127.0.0.1 only: Ray reads the variable at import
    as "single machine" (its child processes), the constant for this one (Ray is imported)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(cfg: DictConfig, kind: Optional[DeviceKind] = None) -> None:
    """Join `devices.ray.address`, or start a local Ray for `cfg`; a no-op when already connected."""
    if ray.is_initialized():
        return
    if cfg.devices.ray.address:
        try:
            ray.init(address=cfg.devices.ray.address)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PlacementError(f"devices.ray.address={cfg.devices.ray.address}: could not join the Ray cluster "
                                 f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                                 "check the address and that this machine's Ray version is the cluster's") from None
        return
    bind_loopback()
    ray.init(**ray_init_kwargs(cfg, kind or detect(cfg.devices.accelerator)))


def disconnect() -> None:
    """Leave Ray now: a Ray this process started stops with its workers; on a cluster the job's
    workers end with the driver's job."""
    ray.shutdown()


def fit_on_cluster(placement: Placement, kind: DeviceKind, address: Optional[str]) -> dict[int, str]:
    """Plan node -> Ray node id, or PlacementError. A plan that would fit an idle cluster but not
    the resources free right now is retried for FIT_SETTLE_S."""
    deadline = time.monotonic() + FIT_SETTLE_S
    while True:
        free = available_resources_per_node()
        nodes = [ClusterNode(n["NodeID"], n["NodeManagerAddress"], dict(free.get(n["NodeID"], {})),
                             dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]
        try:
            return assign_nodes(placement, kind, nodes, address)
        except PlacementError:
            idle = [ClusterNode(n.node_id, n.address, n.total, n.total) for n in nodes]
            assign_nodes(placement, kind, idle, address)  # raises at once when even an idle cluster is too small
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class PlacementPool:
    """The placement group of one pool, shared by its roles; removed when the last one shuts down."""

    def __init__(self, pool: Pool, kind: DeviceKind, node_ids: dict[int, str]):
        self.users = 0
        bundles = [bundle_spec(kind, pool.bundle_size) for _ in pool.bundles]
        selectors = [{"ray.io/node-id": node_ids[slots[0][0]]} for slots in pool.bundles]
        self.pg = placement_group(bundles, strategy=pool.strategy, bundle_label_selector=selectors)
        if not self.pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            self.remove()
            raise PlacementError(
                f"the placement group of the {pool.name} pool ({len(bundles)} bundles of "
                f"{format_resources(bundles[0])}) was not ready after {PLACEMENT_TIMEOUT_S:g} s although the cluster "
                "reported the resources free; another job may have taken them meanwhile"
            )

    def acquire(self) -> "PlacementPool":
        self.users += 1
        return self

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.remove()

    def remove(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class WorkerHost:
    """The body of one Ray actor: one `roles.Worker` for one rank. Started bare, so that every rank
    reports its node (`report`) and joins its process group (`join_group`) before any builds (`build`)."""

    def __init__(self, role: str, rank: int, kind: DeviceKind):
        self.role, self.rank, self.kind = role, rank, kind
        self.worker: Any = None
        self.listen_fd: Optional[int] = None  # rank 0: the socket its group's TCP store serves on

    def device_index(self) -> int:
        """Index, among the devices this process sees, of the device Ray assigned to it."""
        ids = ray.get_runtime_context().get_accelerator_ids().get(self.kind.ray_resource, [])
        visible = os.environ.get(self.kind.visible_env or "", "")
        if not ids or not visible:
            return int(ids[0]) if ids else 0
        order = [v.strip() for v in visible.split(",")]
        return order.index(ids[0]) if ids[0] in order else 0

    def device(self) -> str:
        """The torch device of this rank: "cpu", or the one accelerator Ray assigned ("cuda:0")."""
        device_type = self.kind.torch_device_type
        return device_type if device_type == "cpu" else f"{device_type}:{self.device_index()}"

    def report(self, folder: str, token: str, packages: Sequence[str], models: dict[str, str]) -> NodeReport:
        """`cluster.node_report` of this worker's node: versions, the shared folder, the models."""
        return node_report(folder, token, packages, models)

    def placed(self) -> dict[str, Any]:
        """Where Ray put this process: its node id and the ids of the devices it was given."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(),
                "device_ids": context.get_accelerator_ids().get(self.kind.ray_resource, [])}

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) of the group's TCP store (rank 0 only): a socket on this node's Ray address,
        which every node reaches, held open for `join_group`."""
        address = ray.util.get_node_ip_address()
        self.listen_fd, port = open_store_listener(address)
        return address, port

    def join_group(self, store: tuple[str, int], world_size: int, timeout_s: float) -> str:
        """Join the role's process group (`distributed.join_group`), gloo on the interface that
        reaches `store`; returns that choice ("gloo on eth0 (10.0.0.7)")."""
        interface = choose_gloo_interface(store[0])
        join_group(torch.device(self.device()), self.rank, world_size, store, timeout_s, self.listen_fd)
        return interface

    def round_trip(self) -> float:
        """Seconds of one all_reduce over the group of a CPU tensor (gloo) and, on an accelerator, of a
        device tensor (nccl, hccl): what the check of a pool measures. Each rank contributes 1."""
        import torch.distributed as dist

        device = resolve_device(self.device())
        start = time.perf_counter()
        for where in dict.fromkeys((torch.device("cpu"), device)):
            total = torch.ones(1, device=where)
            dist.all_reduce(total)
            if int(total.item()) != dist.get_world_size():
                raise RuntimeError(f"all_reduce on {where} summed to {total.item():g}, not {dist.get_world_size()}")
        return time.perf_counter() - start

    def build(self, cfg: DictConfig) -> None:
        from ppo_trainer.workers.roles import Worker

        self.worker = Worker(self.role, cfg, self.device())

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.worker.call(method, *args, **kwargs)


def call_concurrency(cfg: DictConfig, role: str) -> int:
    """How many calls one `role` worker runs at once: 1, Ray's default (calls run one at a time, in the
    order they arrive, which the lag schedule relies on: run.pipeline), except partial rollouts' rollout
    workers, which take a weight push beside the generations in flight (at most sampler.max_staleness)."""
    s = cfg.sampler
    return s.max_staleness + 1 if role == "rollout" and s.partial_rollouts else 1


def spawn_hosts(role: str, kind: DeviceKind, placement: RolePlacement, pool: PlacementPool,
                concurrency: int = 1) -> list[Any]:
    """One `WorkerHost` actor per rank of `role`, rank r in bundle r of the pool, running up to
    `concurrency` calls at once (above 1: a threaded actor)."""
    resources = worker_resources(kind, placement.share, placement.devices_per_rank)  # Ray: CPUs and GPUs apart
    options = {"num_cpus": resources.pop("CPU", 0.0), "num_gpus": resources.pop("GPU", 0.0), "resources": resources,
               "max_concurrency": concurrency}
    host = ray.remote(WorkerHost)
    return [host.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pool.pg, placement_group_bundle_index=rank)).remote(role, rank, kind)
            for rank in range(placement.world_size)]


def _describe(error: BaseException) -> str:
    """One line for a worker's error: the remote exception, or how the process died."""
    if isinstance(error, RayTaskError):
        if error.cause is None:
            return str(error).strip().splitlines()[-1]
        # a message that carries a traceback (torch's CheckpointException): its head and its last line
        lines = [line.strip() for line in str(error.cause).splitlines() if line.strip()] or [""]
        text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        return f"{type(error.cause).__name__}: {text}"
    if isinstance(error, RayActorError):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"the worker process died ({type(error).__name__}: {lines[0] if lines else ''})"
    return f"{type(error).__name__}: {error}"


def root_cause(errors: Sequence[str]) -> int:
    """Index of the error to report among ranks' errors in arrival order: the first that is not a
    peer's "connection closed" (a rank whose peer died reports only that), else the first."""
    peer = [any(marker in text.lower() for marker in PEER_ERROR_MARKERS) for text in errors]
    return peer.index(False) if False in peer else 0


class RayWorkers:
    """The workers of one role on Ray: the constructor starts bare processes; `report` checks their
    nodes, `start` joins the role's process group and launches the builds, `ready` waits for them.
    A call `ray.put`s each distinct argument once (one state dict for all rollout replicas)."""

    def __init__(self, cfg: DictConfig, role: str, kind: DeviceKind, placement: RolePlacement, pool: PlacementPool):
        self.role = role
        self.timeout_s = cfg.trainer.worker_timeout_s
        self.collective_timeout_s = cfg.trainer.collective_timeout_s
        self.distributed = role in DISTRIBUTED_ROLES
        self.pool: Optional[PlacementPool] = pool.acquire()
        self.failure: Optional[str] = None
        self.hosts = spawn_hosts(role, kind, placement, pool, call_concurrency(cfg, role))
        self.starting: list[Any] = []
        self.grouped = False  # the ranks joined a process group (`join`): a timeout may be a collective's

    def __len__(self) -> int:
        return len(self.hosts)

    def receivers(self) -> list[Any]:
        """The Ray actors (`WorkerHost`) of the role, for direct calls from another role's worker."""
        return list(self.hosts)

    def on_hosts(self, what: str, method: str, *args: Any) -> list[Any]:
        """`WorkerHost.<method>(*args)` of every rank (the process itself, not its worker), by rank;
        failures and timeouts as for any call (`_gather`), `what` naming the step."""
        return self._gather([getattr(h, method).remote(*args) for h in self.hosts], what)

    def report(self, folder: str, token: str, packages: Sequence[str], models: dict[str, str]) -> list[NodeReport]:
        """Every rank's `WorkerHost.report`."""
        return self.on_hosts("its start check", "report", folder, token, packages, models)

    def join(self) -> list[str]:
        """Join the role's process group on every rank (rank 0 serves its store); each rank's interface."""
        store = self._gather([self.hosts[0].rendezvous.remote()], "its rendezvous")[0]
        self.grouped = True
        return self.on_hosts("joining its process group", "join_group", store, len(self.hosts),
                             self.collective_timeout_s)

    def start(self, cfg: DictConfig) -> None:
        """Join the process group (distributed roles), then launch every rank's build."""
        if self.distributed:
            self.join()
        self.starting = [h.build.remote(cfg) for h in self.hosts]

    def ready(self) -> None:
        """Wait until every rank has built its worker."""
        self._gather(self.starting, "start")

    def submit(self, method: str, args_per_replica: Sequence[tuple], kwargs: dict[str, Any]) -> Pending[list[Any]]:
        """Start the call on every rank; `result()` gathers it (`_gather`) by the deadline
        trainer.worker_timeout_s after this submit: time spent behind earlier calls on an actor counts."""
        deadline = time.monotonic() + self.timeout_s
        refs: dict[int, Any] = {}

        def put(value: Any) -> Any:
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            if id(value) not in refs:
                refs[id(value)] = ray.put(value)
            return refs[id(value)]

        shared_kwargs = {k: put(v) for k, v in kwargs.items()}
        calls = [h.call.remote(method, *map(put, args), **shared_kwargs) for h, args in zip(self.hosts, args_per_replica)]
        return Pending(lambda: self._gather(calls, method, deadline))

    def _gather(self, refs: list[Any], what: str, deadline: Optional[float] = None) -> list[Any]:
        """Results by rank; on a failure, WorkerError (`_fail`); past `deadline` (time.monotonic; None:
        trainer.worker_timeout_s from now), WorkerError naming the first rank still busy, and the role's
        workers are killed (a stuck collective)."""
        if self.failure is not None:
            raise WorkerError(f"the {self.role} workers are down after an earlier failure: {self.failure}")
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                busy = sorted(rank_of[ref] for ref in pending)
                self.failure = (f"{self.role} worker rank {busy[0]} of {len(self.hosts)} did not return from {what} "
                                f"within trainer.worker_timeout_s={self.timeout_s:g} s"
                                + (f" (ranks {', '.join(map(str, busy))} were still busy)" if len(busy) > 1 else ""))
                self._kill()
                raise WorkerError(f"{self.failure}; its workers were stopped. A slow machine or a large model may "
                                  "need a larger trainer.worker_timeout_s")
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except Exception as error:  # noqa: BLE001  (any remote failure is reported the same way)
                failures = [(rank_of[done[0]], error)]
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)  # [] when none left
                for ref in more:
                    try:
                        ray.get(ref)
                    except Exception as other:  # noqa: BLE001
                        failures.append((rank_of[ref], other))
                self._fail(what, failures)
        return results

    def _fail(self, what: str, failures: list[tuple[int, BaseException]]) -> None:
        """WorkerError naming the role, the rank and its own error (`root_cause`); kills a failed process group."""
        texts = [_describe(error) for _, error in failures]
        chosen = root_cause(texts)
        (rank, error), others = failures[chosen], len(texts) - 1
        message = (f"{self.role} worker rank {rank} of {len(self.hosts)} failed in {what}: {texts[chosen]}"
                   + (f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""))
        if self.grouped and any(marker in texts[chosen].lower() for marker in TIMEOUT_MARKERS):
            message += (f"; the {self.role} group's collectives wait at most trainer.collective_timeout_s="
                        f"{self.collective_timeout_s:g} s for a peer rank: one stopped or cannot reach this one "
                        f"(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: docs/cluster.md)")
        if self.distributed and len(self.hosts) > 1:
            self.failure = message  # the other ranks may be stuck in a collective: stop them
            self._kill()
        raise WorkerError(message) from error

    def _kill(self) -> None:
        for h in self.hosts:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(h)

    def shutdown(self) -> None:
        """Kill the actors; the pool's placement group goes with its last role."""
        self._kill()
        self.hosts = []
        if self.pool is not None:
            self.pool.release()
            self.pool = None


def worker_config(cfg: DictConfig) -> DictConfig:
    """`cfg` as workers get it: model paths made absolute against the driver's folder (`cluster.model_paths`)."""
    out = copy.deepcopy(cfg)
    for key, path in model_paths(cfg).items():
        OmegaConf.update(out, key, path)
    return out


def check_workers(cfg: DictConfig, workers: dict[str, RayWorkers]) -> None:
    """ClusterMismatch (one line) unless every worker has the driver's versions of `packages_for(cfg)`,
    sees and can write the output folder the driver sees, and can load the model, before any model loads."""
    folder = Path(os.path.abspath(cfg.trainer.output_dir))
    token = write_marker(folder)
    packages = packages_for(cfg)
    try:
        reports = [r for w in workers.values() for r in w.report(str(folder), token, packages, model_paths(cfg))]
    finally:
        remove_marker(folder)
    check_reports(package_versions(packages), reports)


def build_ray_groups(cfg: DictConfig, kind: DeviceKind) -> dict[str, RayWorkers]:
    """Every role's workers on `kind`, per `plan_placement(cfg)`, once the plan fits and every node
    passed `check_workers`; the roles join their groups and build concurrently."""
    placement = plan_placement(cfg)
    start_ray(cfg, kind)
    node_ids = fit_on_cluster(placement, kind, cfg.devices.ray.address)
    built = worker_config(cfg)
    pools: dict[str, PlacementPool] = {}
    workers: dict[str, RayWorkers] = {}
    try:
        for pool in placement.pools:
            pools[pool.name] = PlacementPool(pool, kind, node_ids)
        for role, role_placement in placement.roles.items():
            workers[role] = RayWorkers(built, role, kind, role_placement, pools[role_placement.pool])
        check_workers(cfg, workers)
        for w in workers.values():
            w.start(built)
        for w in workers.values():
            w.ready()
    except BaseException:
        for w in workers.values():
            w.shutdown()
        for p in pools.values():
            p.remove()
        raise
    log.info("ray: %s", ", ".join(f"{r} x{len(w)}" for r, w in workers.items()))
    return workers
