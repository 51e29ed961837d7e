"""Accelerator names: how torch, Ray and the launcher name each kind of device (`DeviceKind`), the
kind a run uses (`detect`) and how many this process sees. Importing this module needs no torch."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DeviceKind:
    """How one accelerator is named by torch, Ray and the launcher; `torch_device_type` and
    `dist_backend` differ from `name` only for the tests' fake GPUs (placed as GPUs, computing on CPU)."""

    name: str  # "cuda" | "npu" | "cpu"
    torch_device_type: str  # "cuda" | "npu" | "cpu"
    ray_resource: str  # "GPU" | "NPU" | "CPU"
    visible_env: Optional[str]  # the variable Ray sets to the worker's device ids; None on CPU
    dist_backend: str  # "nccl" | "hccl" | "gloo"

    @property
    def label(self) -> str:  # singular, for messages
        return "CPU slot" if self.ray_resource == "CPU" else self.ray_resource

    def count(self, n: float) -> str:
        """"4 GPUs", "1 NPU", "0.33 GPU"."""
        return f"{n:g} {self.label}{'' if n == 1 else 's'}"


KINDS: dict[str, DeviceKind] = {
    "cuda": DeviceKind("cuda", "cuda", "GPU", "CUDA_VISIBLE_DEVICES", "nccl"),
    "npu": DeviceKind("npu", "npu", "NPU", "ASCEND_RT_VISIBLE_DEVICES", "hccl"),
    "cpu": DeviceKind("cpu", "cpu", "CPU", None, "gloo"),
}


def detect(accelerator: str = "auto") -> DeviceKind:
    """The `DeviceKind` of `devices.accelerator`; "auto": cuda, else npu if torch sees one, else cpu."""
    if accelerator == "auto":
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "npu" if local_device_count("npu") > 0 else "cpu"
    if accelerator not in KINDS:
        raise ValueError(f"devices.accelerator is {accelerator!r}; allowed values: cpu, cuda, npu, auto")
    return KINDS[accelerator]


def local_device_count(name: str) -> int:
    """Devices of accelerator `name` ("cuda", "npu") visible to this process (0 without its runtime)."""
    import torch

    if name == "cuda":
        return torch.cuda.device_count()
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.device_count()  # type: ignore[attr-defined]
