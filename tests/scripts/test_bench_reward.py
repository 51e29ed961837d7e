"""scripts/bench_reward.py runs with tiny arguments and prints one line per worker count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_reward.py"


def test_a_tiny_benchmark_prints_a_line_per_worker_count() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--sleep-ms", "1", "--workers", "0,2",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "4 rows x 1 ms sleep (serial sum 0.00 s), median of 1"
    assert [line.split(":")[0] for line in lines[1:]] == ["reward.num_workers=0", "reward.num_workers=2"]
    assert "1.00x the first" in lines[1]
