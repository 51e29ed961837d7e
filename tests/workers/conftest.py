"""One simulated two-node Ray cluster for the whole test session, bound to 127.0.0.1.

Node "a" (the head) has 2 fake GPUs; node "b" has 2 fake GPUs and 2 fake NPUs. Tests join it
through `devices.ray.address` (the code path of a user's existing cluster) and plan with
`devices.devices_per_node=2`. Workers place on the fake devices but compute on CPU
(`computing_on_cpu`): Ray still sets CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from ppo_trainer.workers.accelerators import DeviceKind

NODE_CPUS = 4
NODE_GPUS = 2
NODE_NPUS = 2


def start_cluster(temp_dir: str, attempts: int = 2):
    """The two nodes; retried once, since Ray gives a new node a fixed 30 s to register, which a
    machine busy with other jobs can miss."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(num_cpus=NODE_CPUS, num_gpus=NODE_GPUS, temp_dir=temp_dir, include_dashboard=False),
        )
        try:
            cluster.add_node(num_cpus=NODE_CPUS, num_gpus=NODE_GPUS, resources={"NPU": NODE_NPUS})
            cluster.wait_for_nodes()
            return cluster
        except Exception:
            cluster.shutdown()
            if attempt + 1 == attempts:
                raise


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of the session's cluster; the driver connects on first use (`start_ray`)."""
    pytest.importorskip("ray")
    import ray

    from ppo_trainer.workers.cluster.backend import bind_loopback

    bind_loopback()
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # vLLM's own rendezvous inside the rollout worker
    # Cluster writes its address file into $TMPDIR/ray
    Path(os.environ.get("TMPDIR") or tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        cluster = start_cluster(temp_dir)
        try:
            yield cluster.address
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def computing_on_cpu(kind: DeviceKind) -> DeviceKind:
    """`kind`'s placement (Ray resource, visible-devices variable) with the workers computing on CPU over gloo."""
    return dataclasses.replace(kind, torch_device_type="cpu", dist_backend="gloo")


def ray_overrides(address: str, colocate: bool = False, **roles: int) -> list[str]:
    """Overrides of a Ray run on the session cluster with `roles` devices per role."""
    out = ["devices.backend=ray", "devices.accelerator=cuda", "devices.devices_per_node=2",
           f"devices.colocate={str(colocate).lower()}", f"devices.ray.address={address}"]
    out += [f"devices.{role}.num_devices={n}" for role, n in roles.items()]
    return out


def node_info(hosts: list) -> list[dict[str, Any]]:
    """Where each `WorkerHost` actor runs: Ray node id and address, pid, devices, its process group
    ((rank, world size), or None) and the interface gloo was given."""
    import ray

    def report(host) -> dict[str, Any]:  # nested: cloudpickle ships it by value into the actor
        import os

        import ray
        import torch.distributed as dist

        context = ray.get_runtime_context()
        return {
            "role": host.role, "rank": host.rank, "node_id": context.get_node_id(),
            "address": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "device_ids": context.get_accelerator_ids().get(host.kind.ray_resource, []),
            "visible_devices": os.environ.get(host.kind.visible_env) if host.kind.visible_env else None,
            "group": (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        }

    return ray.get([h.__ray_call__.remote(report) for h in hosts])
