"""Signals, kills and hangs of real runs (slow: each starts ppo-train in a subprocess, the Ray ones a
local Ray cluster). A run stopped any way keeps its last complete checkpoint, says which, and the
same command continues from it; a run killed inside a commit or a rotation resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
SMOKE = ["+experiment=smoke", "trainer.save_every=1", "trainer.loggers=[console,jsonl]"]
RAY = ["devices.backend=ray"]
# A run that kills itself (SIGKILL) at the argv[2]-th os.replace whose target's name starts with
# argv[1]: inside a checkpoint's commit or its rotation.
KILL_AT_RENAME = """
import os, signal, sys
from ppo_trainer.cli import train_main
mark, left, real_replace = sys.argv[1], [int(sys.argv[2])], os.replace
def replace(src, dst):
    if os.path.basename(str(dst)).startswith(mark):
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = replace
train_main(sys.argv[3:])
"""


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled"}


def start(out: Path, *overrides: str, code: str = TRAIN, args: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args, *SMOKE, f"trainer.output_dir={out}", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=out.parent,
                            start_new_session=True)


def run(out: Path, *overrides: str, code: str = TRAIN, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    proc = start(out, *overrides, code=code, args=args)
    stdout, stderr = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def latest(out: Path) -> str:
    pointer = out / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.is_file() else ""


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while latest(out) != f"global_step_{step}":
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no global_step_{step} after {timeout} s"
        time.sleep(0.2)


def metrics(out: Path) -> dict[int, dict]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records}


def test_sigterm_to_the_driver_alone_finishes_the_step_saves_and_the_rerun_continues(tmp_path):
    out = tmp_path / "run"
    proc = start(out, *RAY, "trainer.total_steps=5")
    wait_for_step(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    stopped_at = int(latest(out).rpartition("_")[2])
    assert stopped_at >= 3 and f"run stopped by SIGTERM after step {stopped_at} of 5" in stdout
    rerun = run(out, *RAY, "trainer.total_steps=5")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert latest(out) == "global_step_5" and sorted(metrics(out)) == [0, 1, 2, 3, 4, 5]


def test_sigterm_with_a_rollout_generated_ahead_saves_it_and_no_worker_outlives_the_run(tmp_path):
    """sampler.max_staleness=1: the step finishes and its checkpoint holds the rollout generated during
    it (state/rollouts.pt); the Ray workers are gone when ppo-train returns; the rerun trains on that
    rollout first and keeps the lag."""
    out = tmp_path / "run"
    lagged = [*RAY, "sampler.max_staleness=1", "algorithm.rollout_correction=tis", "trainer.total_steps=5"]
    proc = start(out, *lagged)
    wait_for_step(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    stopped_at = int(latest(out).rpartition("_")[2])
    assert stopped_at < 5 and f"run stopped by SIGTERM after step {stopped_at} of 5" in stdout
    assert (out / "checkpoints" / latest(out) / "state" / "rollouts.pt").is_file()
    time.sleep(5)  # Ray's workers leave as their driver disconnects
    left = subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "ray::WorkerHost"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"Ray workers outlived the run: {left.stdout}"
    rerun = run(out, *lagged)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from run/checkpoints/global_step_{stopped_at}" in rerun.stderr
    staleness = {step: m.get("rollout/staleness/max") for step, m in metrics(out).items() if step}
    assert staleness == {1: 0, 2: 1, 3: 1, 4: 1, 5: 1}


def test_sigterm_to_the_process_group_of_a_ray_run_saves_the_step(tmp_path):
    """The shell's Ctrl-C or `kill -- -PGID`: the driver and the Ray processes it started (Ray puts its
    workers in process groups of their own) get SIGTERM. The step finishes, is saved, Ray is left at once."""
    out = tmp_path / "run"
    proc = start(out, *RAY, "trainer.total_steps=6")
    wait_for_step(out, 2, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    start_time = time.monotonic()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - start_time < 120, "no wait on the dying Ray cluster"
    assert "run stopped by SIGTERM" in stdout and "Failed to connect to GCS" not in stderr
    assert (out / "checkpoints" / latest(out) / "state" / "trainer.json").is_file()


def test_sigterm_to_every_process_of_the_job_stops_with_the_last_checkpoint_named(tmp_path):
    """SLURM's scancel: every process of the job step, the Ray workers too. The step cannot finish:
    exit 128 + 15, one line naming the last complete checkpoint, which the rerun continues from."""
    out = tmp_path / "run"
    proc = start(out, *RAY, "trainer.total_steps=4")
    wait_for_step(out, 2, proc)
    subprocess.run(["pkill", "-TERM", "-s", str(proc.pid)], check=False)
    stdout, stderr = proc.communicate(timeout=300)
    if proc.returncode == 0:  # the step had finished and saved before the workers died
        assert "run stopped by SIGTERM" in stdout
    else:
        assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
        (line,) = [line for line in stderr.splitlines() if line.startswith("ppo-train: stopped")]
        assert f"the last complete checkpoint is run/checkpoints/{latest(out)}: rerun the same command" in line
    before = latest(out)
    rerun = run(out, *RAY, "trainer.total_steps=4")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from run/checkpoints/{before}" in rerun.stderr
    assert sorted(metrics(out)) == [0, 1, 2, 3, 4]


def test_a_ray_worker_killed_mid_run_stops_it_naming_the_rank_and_the_rerun_resumes_exactly(tmp_path):
    reference = run(tmp_path / "reference", *RAY, "trainer.total_steps=4")
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "run"
    proc = start(out, *RAY, "trainer.total_steps=4")
    wait_for_step(out, 2, proc)
    worker = subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "ray::WorkerHost"], capture_output=True, text=True)
    os.kill(int(worker.stdout.split()[0]), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    if proc.returncode != 0:  # else the killed worker's role had no call left before the run ended
        assert proc.returncode == 1, stderr[-3000:]
        (line,) = [line for line in stderr.splitlines() if line.startswith("ppo-train: stopped")]
        assert "worker rank 0 of 1 failed" in line and "the worker process died" in line
        assert "the last complete checkpoint is run/checkpoints/global_step_" in line
    rerun = run(out, *RAY, "trainer.total_steps=4")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert metrics(out) == metrics(tmp_path / "reference")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = run(out, "trainer.total_steps=4", "trainer.keep_last=1")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("mark, nth", [
    ("latest", 2),  # inside step 2's commit: the step renamed into place, `latest` still on step 1
    ("commit_order", 3),  # inside step 3's commit: pointers moved, the commit order not yet recorded
    (".removing_", 2),  # inside step 3's rotation: step 1 moved aside, not yet deleted
])
def test_a_kill_inside_a_commit_or_rotation_resumes_exactly(uninterrupted, tmp_path, mark, nth):
    out = tmp_path / "run"
    killed = run(out, "trainer.total_steps=4", "trainer.keep_last=1", code=KILL_AT_RENAME, args=(mark, str(nth)))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    rerun = run(out, "trainer.total_steps=4", "trainer.keep_last=1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert metrics(out) == metrics(uninterrupted)
    assert not list((out / "checkpoints").glob(".*global_step_*")), "leftovers are gone"


def test_chaos_resume_script_matches_the_uninterrupted_run():
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "chaos_resume.sh")], capture_output=True, text=True,
                            timeout=1200, env={**env(), "KILLS": "3", "PATH": f"{Path(sys.executable).parent}:"
                                                                             f"{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all equal" in result.stdout
