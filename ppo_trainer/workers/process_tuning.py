"""What a worker process sets before it builds an engine: bounded oneDNN kernel caches, and glibc
keeping freed host memory for reuse where the engine computes in host memory."""

from __future__ import annotations

import ctypes
import os

# PyTorch runs bf16 matmuls on a CPU through oneDNN, which keeps a compiled kernel per matmul
# shape in two caches of 1024 entries (oneDNN's own and ideep's), about 1 MB each. Packed
# micro-batches bring new shapes nearly every time, so with those defaults a run's resident size
# grows step after step while the caches fill (docs/performance.md). A micro-batch's forward and
# backward use a few dozen shapes, each reused by every layer; 64 entries keep them.
CPU_KERNEL_CACHE_CAPACITY = 64
CPU_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_cpu_kernel_caches() -> None:
    """Cap oneDNN's kernel caches at `CPU_KERNEL_CACHE_CAPACITY` unless the environment sets them.
    Both are read when the process first runs a oneDNN matmul, so this comes before any engine."""
    for var in CPU_KERNEL_CACHE_VARS:
        os.environ.setdefault(var, str(CPU_KERNEL_CACHE_CAPACITY))


# glibc hands freed memory back to the kernel: a block above its mmap threshold (which adapts up
# to 32 MiB) is unmapped when freed, and a free heap top past the trim threshold is released. A CPU
# worker's phases free and re-allocate gigabytes of activations and gradients, and the next phase
# faults every page handed back in again, zero-filled, at a cost in kernel time of the order of
# the update itself (docs/performance.md). Kept in the heap, freed blocks serve the next phase as
# they are; the resident size then holds at the run's high-water mark, a little above the peak with
# a trim after every call. Each parameter is left to the environment where it sets it (glibc
# reads MALLOC_*_ and GLIBC_TUNABLES at start).
_MALLOPT_PARAMS = {  # <malloc.h> parameter number, value, and how the environment would set it
    "mmap_max": (-4, 0, "MALLOC_MMAP_MAX_"),  # no mmap: large blocks come from the heap too
    "trim_threshold": (-1, -1, "MALLOC_TRIM_THRESHOLD_"),  # -1: never trim the heap's top
}


def keep_freed_host_memory() -> list[str]:
    """Have glibc keep freed memory in this process for reuse (`_MALLOPT_PARAMS`); for workers whose
    tensors live in host memory. Returns the parameters set (none outside glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return []
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return [name for name, (param, value, env) in _MALLOPT_PARAMS.items()
            if env not in os.environ and f"malloc.{name}=" not in tunables and mallopt(param, value) == 1]
