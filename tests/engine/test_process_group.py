"""The process groups the backends make before an engine is built: a one-process run never waits
for the peers that RANK and WORLD_SIZE in its environment promise; a Ray role's group serves its
store on the rendezvous address only and gives up on a missing peer after its timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ppo_trainer.engine.distributed import join_group, open_store_listener

REPO_ROOT = Path(__file__).resolve().parents[2]

# The local backend with every role of the smoke experiment, as a notebook inside a Kubeflow job
# (or a script under torchrun) would build it; prints each role's process group.
BUILD = """
from ppo_trainer.config.composition import compose
from ppo_trainer.workers.group import build_groups
groups = build_groups(compose(["+experiment=smoke"]))
print({role: len(group) for role, group in groups.items()}, groups["actor"].workers.worker.engine.world_size,
      groups["critic"].workers.worker.engine.world_size)
"""


def test_the_one_process_backend_ignores_a_launchers_rank_and_world_size(tmp_path):
    """Before, the engine joined `env://` and waited for rank 0 at MASTER_ADDR:MASTER_PORT (here a
    socket that accepts and never answers) for 30 minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(silent.getsockname()[1]),
               "PPO_TRAINER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", BUILD], env=env, cwd=tmp_path, capture_output=True, text=True,
                                timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "{'actor': 1, 'critic': 1, 'rollout': 1} 1 1"
    assert time.monotonic() - start < 300


def test_a_groups_store_listens_on_the_rendezvous_address_only_and_gives_up_on_a_missing_peer():
    fd, port = open_store_listener("127.0.0.1")
    with socket.socket(fileno=os.dup(fd)) as listener:
        assert listener.getsockname() == ("127.0.0.1", port)  # not 0.0.0.0: no other interface serves it
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"waiting for clients\. 1/2 clients joined"):
        join_group(torch.device("cpu"), 0, 2, ("127.0.0.1", port), 1.0, fd)
    assert time.monotonic() - start < 10
