"""Process group, device mesh and the few collectives the engine needs.

One code path for 1 device and N. The backends create the group before a worker builds its
engine: the local backend a 1-rank group in memory (`init_one_rank`: a `HashStore`, no port, whatever
RANK and WORLD_SIZE the environment holds), the Ray backend each role's group over a TCP store that
rank 0 serves (`join_group`). An engine built without either (a torchrun script, the engine tests)
joins the group the environment describes (`init_distributed`). Accelerators get
"cpu:gloo,<device>:<nccl|hccl>", so the bookkeeping collectives here (CPU tensors) and FSDP's
(device tensors) each find a backend.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}
_MESHES: dict[str, DeviceMesh] = {}


def resolve_device(device: str | torch.device) -> torch.device:
    """The device this rank computes on, made current (nccl/hccl need it); without an index the
    only visible one (Ray), else LOCAL_RANK's (torchrun)."""
    device = torch.device(device)
    if device.type not in _BACKENDS:
        raise ValueError(f"unsupported device {device}; expected cpu, cuda or npu")
    if device.type == "cpu":
        return device
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device type)
    backend = getattr(torch, device.type)
    index = device.index
    if index is None:
        index = 0 if backend.device_count() == 1 else int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device.type, index)
    backend.set_device(device)
    return device


def init_distributed(device: torch.device) -> None:
    """The group a backend made (`init_one_rank`, `join_group`), else the one RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT describe (torchrun), else a 1-rank group; idempotent."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(_BACKENDS[device.type], init_method="env://")
    else:
        init_one_rank(device)


def init_one_rank(device: torch.device) -> None:
    """A 1-rank group in memory for a process that runs every role itself: it never waits for peers
    that RANK/WORLD_SIZE in the environment (a Kubeflow job, a stray torchrun) may promise; idempotent."""
    if not dist.is_initialized():
        dist.init_process_group(_BACKENDS[device.type], store=dist.HashStore(), rank=0, world_size=1)


def open_store_listener(address: str) -> tuple[int, int]:
    """(file descriptor, port) of a listening socket on `address` only, for rank 0's TCP store
    (`join_group`): the store then serves on that address, not on every interface of the node."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen()
    port = listener.getsockname()[1]
    return listener.detach(), port  # the store owns the descriptor from now on


def join_group(device: torch.device, rank: int, world_size: int, store: tuple[str, int], timeout_s: float,
               listen_fd: Optional[int] = None) -> None:
    """Join a `world_size`-rank group whose TCP store rank 0 serves at `store` (host, port), rank 0 on
    `listen_fd` (`open_store_listener`). The rendezvous and every collective of the group fail after
    `timeout_s` instead of waiting for a peer that never comes."""
    timeout = timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(store[0], store[1], world_size, is_master=rank == 0, timeout=timeout,
                        master_listen_fd=listen_fd if rank == 0 else None)
    dist.init_process_group(_BACKENDS[device.type], store=tcp, rank=rank, world_size=world_size, timeout=timeout)


def device_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D data-parallel mesh over all ranks (one per device type, cached)."""
    init_distributed(device)
    if device.type not in _MESHES:
        _MESHES[device.type] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESHES[device.type]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks of a small vector (float64 on CPU, through gloo)."""
    t = torch.as_tensor(values, dtype=torch.float64).clone()
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: int) -> int:
    """The largest `value` over ranks."""
    t = torch.tensor([value], dtype=torch.int64)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
