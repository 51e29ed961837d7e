"""What a worker process sets before it builds an engine, each in a fresh process: glibc keeping freed
host memory, oneDNN's kernel caches bounded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ppo_trainer.dtypes import auto_dtype
from ppo_trainer.workers.process_tuning import CPU_KERNEL_CACHE_VARS

# A 64 MiB tensor is 16,384 pages of 4 KiB. By default glibc maps each such block fresh and unmaps it
# when freed, so every allocation faults all of its pages in again. Kept in the heap, the freed blocks
# serve later allocations once the heap holds a block that fits: small allocations between rounds can
# split the freed block, and the heap grows (fresh pages, faulted once) for up to ~10 rounds first.
_REALLOCATE = """
import resource, torch
from ppo_trainer.workers.process_tuning import keep_freed_host_memory
def faults_of_a_64mb_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)  # freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
applied = keep_freed_host_memory()
print(",".join(applied) or "-", *(faults_of_a_64mb_tensor() for _ in range(24)))
"""


def test_kept_host_memory_serves_later_allocations_without_page_faults():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _REALLOCATE], env=env, capture_output=True, text=True, check=True)
    applied, *faults = out.stdout.split()
    if applied == "-":
        pytest.skip("not glibc: mallopt is absent or ignores these parameters")
    assert applied == "mmap_max,trim_threshold"
    assert int(faults[0]) > 0, "the first 64 MiB tensor faults its pages in (16,384 of 4 KiB; fewer as huge pages)"
    assert sum(map(int, faults[-4:])) < 160, f"freed blocks were handed back and faulted in again: {faults}"


def test_keeping_freed_host_memory_leaves_a_parameter_the_environment_sets():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": str(128 * 2**20)}
    code = "from ppo_trainer.workers.process_tuning import keep_freed_host_memory; print(keep_freed_host_memory())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "trim_threshold" not in out.stdout


# 200 matmul shapes, forward and backward: ~0.45 GB of cached kernels with oneDNN's defaults (measured
# on an AVX-512 BF16 EPYC), ~0.16 GB with the caps, which are set after torch is imported, as in a worker
_MANY_SHAPES = """
import torch
from ppo_trainer.workers.process_tuning import bound_cpu_kernel_caches
bound_cpu_kernel_caches()
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
weight = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.linear(torch.randn(8, 576, dtype=torch.bfloat16), weight).sum().backward()
before = rss_mb()
for rows in range(300, 500):
    torch.nn.functional.linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight).sum().backward()
print(rss_mb() - before)
"""


@pytest.mark.skipif(auto_dtype("cpu")[0] != "bfloat16", reason="bf16 matmuls use oneDNN's cached kernels only on CPUs with bf16 units")
def test_capped_kernel_caches_keep_a_process_of_ever_new_matmul_shapes_from_growing():
    env = {k: v for k, v in os.environ.items() if k not in CPU_KERNEL_CACHE_VARS}
    out = subprocess.run([sys.executable, "-c", _MANY_SHAPES], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) < 300, f"resident size grew {out.stdout.strip()} MB over 200 matmul shapes"
