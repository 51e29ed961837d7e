"""One intra-op thread for these tests: the models are tiny, and on a shared 2-core machine two
spinning OpenMP threads per process make every op up to 10x slower than one."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
