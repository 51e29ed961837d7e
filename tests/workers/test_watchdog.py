"""No call waits forever on the local backend: past trainer.worker_timeout_s the watchdog names the
role and the method, dumps every thread's stack and ends the process with exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

HANGING_CALL = """
import logging, time
from ppo_trainer.workers.group import LocalWorkers
logging.basicConfig(level=logging.INFO, format="%(message)s")

class Stuck:
    def call(self, method, *args):
        time.sleep(60)  # a collective whose peer never comes

LocalWorkers(Stuck(), "critic", timeout_s=1.0).submit("update", [()], {}).result()
print("not reached")
"""


def test_a_local_call_past_the_timeout_dumps_the_stacks_and_exits_1():
    result = subprocess.run([sys.executable, "-c", HANGING_CALL], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 1
    assert "not reached" not in result.stdout
    assert result.stderr.startswith("ppo-train: the critic worker's update did not return within "
                                    "trainer.worker_timeout_s=1 s; stopped")
    assert "(most recent call first)" in result.stderr and "line 8 in call" in result.stderr  # the stuck frame
