"""The compute dtype of a dtype key (`model.dtype`, `critic.dtype`, `reward.model.dtype`): its value,
or for "auto" the best dtype the device computes natively. Importing this module needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

# CPU flags of native bf16 matmuls: with them bf16 is several times faster than fp32; without them
# bf16 falls back to slow conversions, far slower than fp32 (docs/performance.md has the rates).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this CPU (first "flags" line of /proc/cpuinfo; empty where absent)."""
    try:
        with open(cpuinfo) as f:
            return next((set(line.partition(":")[2].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def auto_dtype(device_type: str, flags: Optional[set[str]] = None) -> tuple[str, str]:
    """(compute dtype, reason) for `dtype=auto` on `device_type` ("cuda", "npu", "cpu"): bfloat16
    where the device computes it natively, float32 elsewhere (a GPU older than compute capability
    8.0, Ampere: fp16 would need loss scaling, which the engines do not do). `flags` defaults to
    `cpu_flags()`; a GPU this process does not see is taken to have bf16."""
    if device_type == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
            major, minor = torch.cuda.get_device_capability()
            return "float32", (f"the GPU's compute capability {major}.{minor} has no bf16 (8.0 and later do); fp16 "
                               "would need loss scaling, which the trainer does not do")
        return "bfloat16", "cuda computes bf16 natively"
    if device_type == "npu":
        return "bfloat16", "npu computes bf16 natively"
    found = [f for f in BF16_CPU_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if found:
        return "bfloat16", f"the CPU has {found[0]}"
    return "float32", f"the CPU lacks {' and '.join(BF16_CPU_FLAGS)}: bf16 would be slower than fp32"


def resolve_dtype(name: str, device_type: str) -> str:
    """A dtype key's value ("auto", "bfloat16", "float32", "float16") as a concrete dtype name."""
    return auto_dtype(device_type)[0] if name == "auto" else name


def compute_dtype(name: str, device_type: str = "cpu") -> "torch.dtype":
    """The torch dtype of a dtype key's value (config.py checked it); "auto" resolves for `device_type`."""
    import torch

    return getattr(torch, resolve_dtype(name, device_type))
