"""The placement of each role's ranks on devices and nodes: the plan from the `devices` config
(`plan_placement`), its dry-run lines, the check that a Ray cluster can take it and the Ray nodes it
lands on (`assign_nodes`), and the arguments of a local Ray. Importing this module needs no torch."""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from omegaconf import DictConfig

from ppo_trainer.config.derived import uses_critic
from ppo_trainer.errors import InputError
from ppo_trainer.workers.accelerators import DeviceKind, local_device_count

ROLES = ("actor", "critic", "rollout")
DISTRIBUTED_ROLES = ("actor", "critic")  # FSDP: one process group per role; rollout replicas are independent
SHARED_POOL = "shared"


def roles_of(cfg: DictConfig) -> tuple[str, ...]:
    """The roles a run builds: actor, critic (not for a critic-free algorithm.adv_estimator) and rollout,
    and a reward model when reward.model.path names one."""
    roles = tuple(role for role in ROLES if role != "critic" or uses_critic(cfg))
    return (*roles, "reward_model") if cfg.reward.model.path else roles


class PlacementError(InputError):
    """The cluster cannot take the run (too small, or not reachable); the message names the config key
    and the numbers."""


@dataclass(frozen=True)
class Pool:
    """Devices reserved together (one Ray placement group, one bundle per `bundle_size` devices of one
    node); `slots[d]` is the (plan node, local device index) of device d, bundle b holds devices
    b * bundle_size .. (b + 1) * bundle_size - 1."""

    name: str  # the role for a separate pool, SHARED_POOL for colocated roles
    roles: tuple[str, ...]
    slots: tuple[tuple[int, int], ...]
    bundle_size: int = 1  # sampler.vllm.tensor_parallel_size for the rollout's pool, else 1

    @property
    def bundles(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The slots of each bundle (all on one node)."""
        k = self.bundle_size
        return tuple(self.slots[b : b + k] for b in range(0, len(self.slots), k))

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({node for node, _ in self.slots}))

    @property
    def strategy(self) -> str:
        """STRICT_PACK on one node, else SPREAD (each bundle is pinned to its node anyway)."""
        return "STRICT_PACK" if len(self.nodes) == 1 else "SPREAD"

    def per_node(self) -> dict[int, list[int]]:
        """Plan node -> local device indices of this pool there, nodes in the order of the slots."""
        return {node: [d for n, d in self.slots if n == node] for node in dict.fromkeys(n for n, _ in self.slots)}


@dataclass(frozen=True)
class RolePlacement:
    """Rank r of a role occupies bundle r of pool `pool`: `devices_per_rank` devices from `ranks[r]` =
    (plan node, local device index of the first) on, taking `share` of each."""

    pool: str
    ranks: tuple[tuple[int, int], ...]
    share: float  # 1.0 for a separate pool; a fraction when colocated roles share the device
    devices_per_rank: int = 1  # a tensor-parallel rollout replica's k devices

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Placement:
    """The whole plan: pools of devices and the ranks of every role on them."""

    backend: str
    devices_per_node: int
    pools: tuple[Pool, ...]
    roles: Mapping[str, RolePlacement]

    @property
    def num_devices(self) -> int:
        return sum(len(p.slots) for p in self.pools)

    @property
    def num_nodes(self) -> int:
        return len({node for p in self.pools for node in p.nodes})

    @property
    def num_workers(self) -> int:
        return sum(r.world_size for r in self.roles.values())


def _first_fit(free: list[int], count: int, devices_per_node: int, unit: int = 1) -> list[tuple[int, int]]:
    """Take `count` devices (a multiple of `unit`) from plan nodes with `free[node]` devices left (grown
    as needed), in blocks of `unit` that never straddle two nodes: as many whole blocks as a node holds
    on each fresh node, then the remainder on the first node with room."""
    per_node = devices_per_node // unit * unit
    whole, rest = divmod(count, per_node)
    slots: list[tuple[int, int]] = []
    for n in [per_node] * whole + [rest] * (rest > 0):
        node = next((i for i, f in enumerate(free) if f >= n), len(free))
        if node == len(free):  # a fresh node
            free.append(devices_per_node)
        used = devices_per_node - free[node]
        slots.extend((node, used + i) for i in range(n))
        free[node] -= n
    return slots


def plan_placement(cfg: DictConfig) -> Placement:
    """Every role's devices (`roles_of`) from the `devices` config alone. Local: one shared device.
    Ray: each role's pool first fit, or (colocated) one pool of max(num_devices) shared."""
    dev = cfg.devices
    names = roles_of(cfg)
    counts = {role: int(dev[role].num_devices) for role in names}
    per_node = int(dev.devices_per_node)
    if dev.backend == "local":
        roles = {r: RolePlacement(SHARED_POOL, ((0, 0),), 1.0) for r in names}
        return Placement("local", per_node, (Pool(SHARED_POOL, names, ((0, 0),)),), roles)
    free: list[int] = []
    if dev.colocate:
        slots = tuple(_first_fit(free, max(counts.values()), per_node))
        pools: tuple[Pool, ...] = (Pool(SHARED_POOL, names, slots),)
        share = math.floor(100 / len(names)) / 100  # 1/n rounded down to 0.01, so the n roles fit in one device
        roles = {r: RolePlacement(SHARED_POOL, slots[: counts[r]], share) for r in names}
    else:  # validation keeps tensor-parallel rollouts (k > 1) out of colocated plans
        k = {r: int(cfg.sampler.vllm.tensor_parallel_size) if r == "rollout" else 1 for r in names}
        pools = tuple(Pool(r, (r,), tuple(_first_fit(free, counts[r], per_node, k[r])), k[r]) for r in names)
        roles = {p.name: RolePlacement(p.name, p.slots[:: p.bundle_size], 1.0, p.bundle_size) for p in pools}
    return Placement("ray", per_node, pools, roles)


def _ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for x in indices:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def format_resources(resources: Mapping[str, float]) -> str:
    """{"GPU": 1.0, "CPU": 0.33} -> "{GPU: 1, CPU: 0.33}"."""
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def bundle_spec(kind: DeviceKind, devices: int = 1) -> dict[str, float]:
    """One placement-group bundle: `devices` devices, plus one CPU to drive each (a tensor-parallel
    engine runs a process per device). On CPUs a device is a CPU slot: a vLLM rank's process."""
    k = float(devices)
    return {kind.ray_resource: k} if kind.ray_resource == "CPU" else {kind.ray_resource: k, "CPU": k}


def worker_resources(kind: DeviceKind, share: float, devices: int = 1) -> dict[str, float]:
    """What one worker asks of its bundle of `devices` devices: `share` of each device and CPU."""
    return {name: amount * share for name, amount in bundle_spec(kind, devices).items()}


def describe_placement(placement: Placement, kind: DeviceKind) -> list[str]:
    """Dry-run lines: each pool's devices per node and placement group, each role's ranks."""
    if placement.backend == "local":
        return [f"  {', '.join(placement.pools[0].roles)} share one {kind.torch_device_type} device in this process"]
    lines = []
    for p in placement.pools:
        n, b = len(p.slots), len(p.bundles)
        head = f"{'/'.join(p.roles)} pool" if len(p.roles) > 1 else f"{p.name:8s}"
        where = "; ".join(f"node {node}: {kind.label} {_ranges(d)}" for node, d in p.per_node().items())
        lines.append(f"  {head} {kind.count(n)} ({where}); placement group {p.strategy}, "
                     f"{b} bundle{'s' if b > 1 else ''} of {format_resources(bundle_spec(kind, p.bundle_size))}")
        if "rollout" in p.roles:
            lines.append(replicas_line(placement.roles["rollout"], kind))
        for role in p.roles if len(p.roles) > 1 else ():
            r = placement.roles[role]
            share = format_resources(worker_resources(kind, r.share))
            # vLLM's sleep mode is off on CPUs (and sampler.max_staleness >= 1 is refused where it is on)
            sleeps = " (its engine sleeps while actor and critic train)" if role == "rollout" and kind.name != "cpu" else ""
            lines.append(f"    {role:8s} {r.world_size} worker{'s' if r.world_size > 1 else ''}, rank i on "
                         f"bundle i (bundles {_ranges(range(r.world_size))}), each {share}{sleeps}")
    return lines


def replicas_line(rollout: RolePlacement, kind: DeviceKind) -> str:
    """The rollout's engines and their devices: "    rollout: 2 replicas x tensor parallel 2 (node 1: GPU
    0-1 | node 1: GPU 2-3); ..." (one engine per device: the devices per node, as the pool's line)."""
    k, n = rollout.devices_per_rank, rollout.world_size
    if k == 1:
        nodes = {node: [d for m, d in rollout.ranks if m == node] for node in dict.fromkeys(m for m, _ in rollout.ranks)}
        devices = "; ".join(f"node {node}: {kind.label} {_ranges(d)}" for node, d in nodes.items())
    else:
        devices = " | ".join(f"node {node}: {kind.label} {first}-{first + k - 1}" for node, first in rollout.ranks)
    ranks = (f"one Ray actor per replica, its engine's {k} ranks in processes of their own" if k > 1
             else "one Ray actor per replica")
    return f"    rollout: {n} replica{'s' if n > 1 else ''} x tensor parallel {k} ({devices}); {ranks}"


@dataclass(frozen=True)
class ClusterNode:
    """One alive Ray node: its id, address and the resources it has free and in total."""

    node_id: str
    address: str
    free: Mapping[str, float]
    total: Mapping[str, float]

    def short(self) -> str:
        return f"{self.address} [{self.node_id[:8]}]"


def _pool_key(pool: Pool) -> str:
    """The config keys that size `pool` (for messages)."""
    if len(pool.roles) == 1:
        return f"devices.{pool.name}.num_devices={len(pool.slots)}"
    return f"devices.colocate=true (a shared pool of max(devices.*.num_devices)={len(pool.slots)})"


def check_fit(placement: Placement, kind: DeviceKind, nodes: Sequence[ClusterNode], address: Optional[str]) -> None:
    """PlacementError, naming the first pool that does not fit, unless the cluster has the plan's total free."""
    resource = kind.ray_resource
    free_total = sum(n.free.get(resource, 0.0) for n in nodes)
    have_total = sum(n.total.get(resource, 0.0) for n in nodes)
    if have_total == 0 and resource == "NPU":
        where = f"the Ray cluster at {address}" if address else "the local Ray cluster"
        join = f"--address={address} " if address else ""
        raise PlacementError(
            f"devices.accelerator=npu, but no node of {where} announces NPUs. Ray detects Ascend NPUs "
            f"only where the Ascend runtime (acl) imports; start each node with them declared: "
            f"ray start {join}--resources='{{\"NPU\": {placement.devices_per_node}}}'"
        )
    per_node = ", ".join(f"{n.short()}: {n.free.get(resource, 0.0):g} free of {n.total.get(resource, 0.0):g}"
                         for n in nodes) or "no alive nodes"
    before: list[str] = []
    used = 0.0
    for p in placement.pools:
        if used + len(p.slots) > free_total + 1e-9:
            taken = f", of which {', '.join(before)} take {used:g}" if before else ""
            raise PlacementError(
                f"{_pool_key(p)} {kind.label}s do not fit: the cluster has {kind.count(free_total)} "
                f"free{taken} ({kind.count(have_total)} in total; per node: {per_node}). Ask for fewer devices, "
                "free them, or add nodes to the cluster"
            )
        used += len(p.slots)
        before.append(_pool_key(p))
    cpu_free = sum(n.free.get("CPU", 0.0) for n in nodes)
    if resource != "CPU" and placement.num_devices > cpu_free + 1e-9:
        raise PlacementError(
            f"the plan needs {placement.num_devices} logical CPUs (one to drive each {kind.label}) but the cluster "
            f"has {cpu_free:g} free; declare more with devices.ray.num_cpus (local Ray) or ray start --num-cpus"
        )


def assign_nodes(placement: Placement, kind: DeviceKind, nodes: Sequence[ClusterNode],
                 address: Optional[str] = None) -> dict[int, str]:
    """Plan node -> Ray node id with enough free: largest needs first, each to the first node that
    fits, preferring nodes no other plan node took. Raises PlacementError with the numbers."""
    check_fit(placement, kind, nodes, address)
    devices_by_node = Counter(node for p in placement.pools for node, _ in p.slots)
    need = {node: {name: amount * devices for name, amount in bundle_spec(kind).items()}
            for node, devices in devices_by_node.items()}
    free = {n.node_id: dict(n.free) for n in nodes}
    mapping: dict[int, str] = {}
    for plan_node in sorted(need, key=lambda k: (-need[k].get(kind.ray_resource, 0.0), k)):
        want, taken = need[plan_node], set(mapping.values())
        fits = [nid for nid in free if all(free[nid].get(r, 0.0) + 1e-9 >= a for r, a in want.items())]
        chosen = min(fits, key=lambda nid: nid in taken, default=None)
        if chosen is None:
            keys = ", ".join(_pool_key(p) for p in placement.pools if plan_node in p.nodes)
            largest = max((f.get(kind.ray_resource, 0.0) for f in free.values()), default=0.0)
            raise PlacementError(
                f"{keys}: the plan puts {kind.count(want[kind.ray_resource])} on one "
                f"node (devices.devices_per_node={placement.devices_per_node}), but no Ray node has that many "
                f"free (the most free on one node is {kind.count(largest)}; per node: "
                + ", ".join(f"{n.short()}: {free[n.node_id].get(kind.ray_resource, 0.0):g}" for n in nodes)
                + "). Set devices.devices_per_node to what your nodes have, or ask for fewer devices"
            )
        for r, a in want.items():
            free[chosen][r] = free[chosen].get(r, 0.0) - a
        mapping[plan_node] = chosen
    return mapping


def ray_init_kwargs(cfg: DictConfig, kind: DeviceKind) -> dict[str, Any]:
    """`ray.init` arguments of a local Ray: loopback only, logical CPUs = devices.ray.num_cpus, else
    max(cores, devices + 1) (a 2-core machine still places 4 one-CPU bundles); on NPU the NPUs
    torch_npu sees, as the "NPU" resource (Ray detects them only where the Ascend runtime imports)."""
    kwargs: dict[str, Any] = {
        "num_cpus": cfg.devices.ray.num_cpus or max(os.cpu_count() or 1, plan_placement(cfg).num_devices + 1),
        "include_dashboard": bool(cfg.devices.ray.dashboard),
        "_node_ip_address": "127.0.0.1",
    }
    n = local_device_count("npu") if kind.ray_resource == "NPU" else 0
    if n > 0:
        kwargs["resources"] = {"NPU": float(n)}
    return kwargs
