"""Process group, device mesh and the few collectives the engine needs.

One code path for 1 device and N: without RANK/WORLD_SIZE a 1-rank group lives in memory (a
`HashStore`, no port). Accelerators get "cpu:gloo,<device>:<nccl|hccl>", so the bookkeeping
collectives here (CPU tensors) and FSDP's (device tensors) each find a backend.
"""

from __future__ import annotations

import os
from typing import Sequence

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
    """Join the process group of this run, or create a 1-rank group; idempotent."""
    if dist.is_initialized():
        return
    backend = _BACKENDS[device.type]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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
