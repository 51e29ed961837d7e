"""scripts/gpu_check.sh --rehearse: the GPU check's steps on the CPU with tiny shapes (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    # the script runs the `python3` on PATH (the GPU machine's): here, the one running the tests
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--rehearse"], capture_output=True,
                            text=True, timeout=1200,
                            env={**os.environ, "PATH": path, "OUT": str(tmp_path), "GPU_CHECK_TIMEOUT": "1100"})
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.returncode == 0 and summary["ok"], result.stdout[-3000:] + result.stderr[-3000:]
    assert list(summary["steps"]) == ["device", "model", "memory plan", "one PPO step", "DCP resume round trip",
                                      "export reload", "packed attention"]
    step = summary["steps"]["one PPO step"]
    assert step["response_length"] == 16 and set(step["peak_gib_by_role"]) == {"actor", "critic", "rollout"}


def test_the_gpu_check_says_what_to_do_without_hydra_and_without_wheels(tmp_path):
    """On the GPU machine Hydra comes as wheels in .whl/ (--prepare makes them): none there is named."""
    script = REPO_ROOT / "scripts" / "gpu_check.sh"
    fake_python = tmp_path / "bin" / "python3"
    fake_python.parent.mkdir()
    fake_python.write_text("#!/bin/sh\nexit 1\n")  # `import hydra` fails
    fake_python.chmod(0o755)
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_check.sh").write_text(script.read_text())
    result = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{fake_python.parent}:{os.environ['PATH']}"}, timeout=60)
    assert result.returncode == 2 and "run bash scripts/gpu_check.sh --prepare" in result.stderr
