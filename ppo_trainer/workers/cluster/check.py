"""The check of a Ray cluster a user runs before a long job: `ppo-train ... trainer.dry_run=true
devices.ray.address=HOST:PORT` prints the plan, then this. Every node answers a task pinned to it and
receives an object from the driver, has the driver's versions, sees the output folder and can write
there, and resolves the model; the plan's pools are placed on the nodes and devices planned; the
ranks of each pool complete a collective round trip over the backend the run uses (gloo, and nccl
or hccl on accelerators). Nothing of the run is written: the folder's marker is removed again."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
from omegaconf import DictConfig
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ppo_trainer.workers.accelerators import DeviceKind, detect
from ppo_trainer.workers.cluster.backend import (
    PlacementPool,
    RayWorkers,
    disconnect,
    fit_on_cluster,
    start_ray,
    worker_config,
)
from ppo_trainer.workers.cluster.nodes import (
    CLUSTER_DOC,
    ClusterMismatch,
    NodeReport,
    model_paths,
    node_report,
    package_versions,
    packages_for,
    ray_address_problem,
    remove_marker,
    version_problems,
    write_marker,
)
from ppo_trainer.workers.cluster.placement import PlacementError, RolePlacement, plan_placement
from ppo_trainer.workers.roles import WorkerError

NODE_TIMEOUT_S = 120.0  # a node whose pinned task has not answered by then is unreachable
PAYLOAD_BYTES = 2**20  # the object each node receives from the driver's object store


@dataclass
class Check:
    """The console lines of the check and the problems it found (each one line)."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.problems.append(problem)
        self.lines.append(f"FAILED: {problem}")


def probe_node(folder: str, token: str, packages: Sequence[str], models: dict[str, str],
               payload: bytes) -> tuple[NodeReport, int]:
    """A node's `node_report` and the size of the object it received (runs on that node)."""
    return node_report(folder, token, packages, models), len(payload)


def node_name(node: dict[str, Any]) -> str:
    """A `ray.nodes()` entry as the check names it: "127.0.0.1 [7091457e]"."""
    return f"{node['NodeManagerAddress']} [{node['NodeID'][:8]}]"


def check_nodes(cfg: DictConfig, folder: Path, token: str, check: Check) -> None:
    """One task pinned to each alive node: it answers, receives PAYLOAD_BYTES from the driver, and reports
    (`probe_node`); then the versions, the folder and the model over all nodes."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    packages, models = packages_for(cfg), model_paths(cfg)
    probe = ray.remote(num_cpus=0)(probe_node)
    payload = ray.put(bytes(PAYLOAD_BYTES))
    start = time.monotonic()
    refs = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(str(folder), token, packages, models, payload): n for n in nodes}
    answered: dict[Any, float] = {}  # ref -> seconds until its node answered
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, start + NODE_TIMEOUT_S - time.monotonic()))
        if not done:
            break
        answered[done[0]] = time.monotonic() - start
    reports: list[NodeReport] = []
    for ref, node in refs.items():
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(node["Resources"].items())
                              if k in ("CPU", "GPU", "NPU"))
        if ref not in answered:
            check.fail(f"node {node_name(node)} did not answer a task within {NODE_TIMEOUT_S:g} s: check that it "
                       f"and the driver reach each other on Ray's ports ({CLUSTER_DOC})")
            continue
        try:
            report, received = ray.get(ref)
        except Exception as e:  # noqa: BLE001  (a node that cannot import ppo_trainer, a broken install)
            check.fail(f"node {node_name(node)}: the check could not run there ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); install ppo-trainer there")
            continue
        reports.append(report)
        check.lines.append(f"{report.node}: {resources}; answered and received a {received // 2**20} MiB object "
                           f"in {answered[ref]:.1f} s")
    driver = package_versions(packages)
    mismatches = version_problems(driver, reports)
    for problem in mismatches:
        check.fail(problem)
    if not mismatches:
        check.lines.append(f"versions: {', '.join(f'{p} {v}' for p, v in driver.items())} on the driver and "
                           f"{len(reports)} node{'s' if len(reports) != 1 else ''}")
    own = [p for report in reports for p in report.problems]
    for problem in own:
        check.fail(problem)
    if reports and not own:
        check.lines.append(f"folder:   {folder}: every node sees the driver's marker in it and can write there")
        check.lines.append(f"model:    {', '.join(f'{k}={v}' for k, v in models.items())} resolves on every node")


def check_pools(cfg: DictConfig, kind: DeviceKind, check: Check) -> None:
    """The plan's pools in their placement groups, one bare worker per bundle (a device, or a
    tensor-parallel rollout replica's devices): each where the plan put it, then a collective round
    trip over each pool's ranks."""
    placement = plan_placement(cfg)
    try:
        node_ids = fit_on_cluster(placement, kind, cfg.devices.ray.address)
    except PlacementError as e:
        check.fail(str(e))
        return
    groups: dict[str, RayWorkers] = {}
    try:
        for pool in placement.pools:
            name = f"{'/'.join(pool.roles)} pool"
            k = pool.bundle_size
            ranks = RolePlacement(pool.name, pool.slots[::k], 1.0, k)
            groups[name] = RayWorkers(worker_config(cfg), name, kind, ranks, PlacementPool(pool, kind, node_ids))
            for (plan_node, device), seen in zip(ranks.ranks, groups[name].on_hosts("its placement", "placed")):
                where = f"plan node {plan_node} {kind.label} {device}" + (f"-{device + k - 1}" if k > 1 else "")
                if seen["node_id"] != node_ids[plan_node]:
                    check.fail(f"{name}: {where} runs on Ray node {seen['node_id'][:8]}, not {node_ids[plan_node][:8]}")
                elif kind.ray_resource != "CPU" and len(seen["device_ids"]) != k:
                    check.fail(f"{name}: {where} was given {kind.label}s {seen['device_ids']}, not {k}")
            per_node = {node_ids[n]: devices for n, devices in pool.per_node().items()}
            check.lines.append(f"{name}: " + "; ".join(f"{len(devices)} {kind.label}{'s' if len(devices) > 1 else ''} "
                                                       f"on Ray node {node[:8]}" for node, devices in per_node.items())
                               + ", as planned")
        for name, workers in groups.items():
            interfaces = workers.join()
            seconds = max(workers.on_hosts("a collective round trip", "round_trip"))
            device = "" if kind.dist_backend == "gloo" else f"; {kind.dist_backend} for {kind.label} tensors"
            check.lines.append(f"{name}: all_reduce over {len(workers)} rank{'s' if len(workers) > 1 else ''} in "
                               f"{seconds * 1000:.1f} ms ({', '.join(dict.fromkeys(interfaces))}{device})")
    except (WorkerError, PlacementError) as e:
        check.fail(str(e))
    finally:
        for workers in groups.values():
            workers.shutdown()


def check_cluster(cfg: DictConfig, kind: Optional[DeviceKind] = None) -> Check:
    """Every check of this module on the cluster at devices.ray.address (joined here, left after)."""
    check = Check()
    address = cfg.devices.ray.address
    unreachable = ray_address_problem(address)
    if unreachable:
        check.fail(unreachable)
        return check
    kind = kind or detect(cfg.devices.accelerator)
    try:
        start_ray(cfg, kind)
    except PlacementError as e:
        check.fail(str(e))
        return check
    folder = Path(cfg.trainer.output_dir)
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # what write_marker creates, innermost first
    token = write_marker(folder)
    try:
        check_nodes(cfg, folder, token, check)
        check_pools(cfg, kind, check)
    finally:
        remove_marker(folder)
        for empty in made:
            if not any(empty.iterdir()):
                empty.rmdir()
        disconnect()
    return check


def run_check(cfg: DictConfig) -> None:
    """Print the cluster check of `cfg` (the dry run's last section); ClusterMismatch naming the problems."""
    print(f"\n# cluster check: Ray at {cfg.devices.ray.address}", flush=True)
    check = check_cluster(cfg)
    print("\n".join(check.lines), flush=True)
    if check.problems:
        count = len(check.problems)
        raise ClusterMismatch(f"the cluster check found {count} problem{'s' if count > 1 else ''}: "
                              + "; ".join(check.problems))
    print("cluster check passed: a run of this config can start here", flush=True)
