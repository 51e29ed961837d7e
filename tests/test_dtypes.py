"""`dtype=auto`: bf16 where the device computes it natively, float32 elsewhere."""

from __future__ import annotations

import torch

from ppo_trainer.dtypes import auto_dtype, cpu_flags, resolve_dtype


def test_auto_dtype_is_bf16_on_accelerators_and_on_cpus_with_bf16_matrix_instructions(tmp_path):
    assert auto_dtype("cuda")[0] == "bfloat16" and auto_dtype("npu")[0] == "bfloat16"
    assert auto_dtype("cpu", {"avx2", "avx512f", "avx512_bf16"}) == ("bfloat16", "the CPU has avx512_bf16")
    assert auto_dtype("cpu", {"avx2", "amx_bf16", "amx_tile"})[0] == "bfloat16"
    dtype, why = auto_dtype("cpu", {"avx2", "fma"})  # an AVX2-only EPYC: bf16 is slow there
    assert dtype == "float32" and "avx512_bf16" in why
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == set()  # no /proc/cpuinfo (macOS): float32
    assert resolve_dtype("float32", "cuda") == "float32" and resolve_dtype("auto", "cuda") == "bfloat16"


def test_auto_dtype_on_a_gpu_without_bf16_is_float32(monkeypatch):
    """A V100 or T4 (compute capability 7.x): no bf16; fp16 would need loss scaling."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    dtype, why = auto_dtype("cuda")
    assert dtype == "float32" and "compute capability 7.0 has no bf16" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert auto_dtype("cuda")[0] == "bfloat16"
