"""The reward worker pool (reward.num_workers): calls overlap, reward.timeout_s bounds each call, a
timed-out or dead worker is replaced, workers hold none of the driver's descriptors (the output
folder's lock) and end with a SIGKILLed driver, and what a worker starts ends with the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import RewardError, RewardInput
from ppo_trainer.rewards.scoring import build_scorer
from ppo_trainer.run.folder import LOCK_FILE, exclusive

REPO_ROOT = Path(__file__).resolve().parents[2]

REWARDS = """
import os, signal, subprocess, time
from pathlib import Path

def overlap(solution_str, ground_truth, extra_info):
    '''Counts the calls running at once: each leaves a file in extra_info["dir"] while it sleeps.'''
    folder = Path(extra_info["dir"])
    mine = folder / f"{os.getpid()}-{solution_str}"
    mine.touch()
    time.sleep(0.5)
    running = len(list(folder.iterdir()))
    mine.unlink()
    return {"score": 1.0, "running": running}

def sleepy(solution_str, ground_truth, extra_info):
    if extra_info.get("started"):
        Path(extra_info["started"], str(os.getpid())).touch()
    time.sleep(extra_info["sleep"])
    return 1.0

def crashing(solution_str, ground_truth):
    if solution_str == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0

def spawning(solution_str, ground_truth, extra_info):
    '''Starts a process that would sleep ten minutes (a sandbox, say), writes its pid to
    extra_info["pid_file"], then dies ("die"), hangs ("hang") or returns.'''
    child = subprocess.Popen(["sleep", "600"])
    Path(extra_info["pid_file"]).write_text(str(child.pid))
    if solution_str == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "hang":
        time.sleep(600)
    return 1.0

def open_files():
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return targets

def lock_descriptors(solution_str, ground_truth):
    return {"score": 1.0, "lock_fds": sum(t.endswith("LOCK") for t in open_files()), "session": os.getsid(0)}
""".replace("LOCK", LOCK_FILE)


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool_rewards.py"
    path.write_text(REWARDS)
    return path


def pids(scorer) -> list[int]:
    return [w.process.pid for w in scorer.pool.workers]


def inputs(*responses: str, extra: dict | None = None) -> list[RewardInput]:
    return [RewardInput(r, "1", "src", extra, "prompt") for r in responses]


def test_calls_on_two_workers_overlap(rewards_file, tmp_path):
    (tmp_path / "running").mkdir()
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:overlap", num_workers=2))
    try:
        scores = scorer.score(inputs(*"abcdef", extra={"dir": str(tmp_path / "running")}))
    finally:
        scorer.close()
    assert scores.values == [1.0] * 6
    assert max(e["running"] for e in scores.extras) >= 2  # the most calls seen running at once


def test_a_call_past_the_timeout_fails_its_row_and_its_worker_is_replaced(rewards_file):
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:sleepy", num_workers=2, timeout_s=1.0, on_error="zero"))
    try:
        before = set(pids(scorer))
        started = time.monotonic()
        rows = [*inputs("a", extra={"sleep": 0}), *inputs("b", extra={"sleep": 60}), *inputs("c", extra={"sleep": 0})]
        scores = scorer.score(rows)
        assert time.monotonic() - started < 30
        assert scores.values == [1.0, 0.0, 1.0]
        assert (scores.errors, scores.timeouts) == (1, 1)
        after = set(pids(scorer))
        assert len(before & after) == 1 and len(after) == 2  # the hung worker's place has a new process
        assert scorer.score(inputs("d", "e", extra={"sleep": 0})).values == [1.0, 1.0]
    finally:
        scorer.close()


def test_a_timeout_under_on_error_raise_stops_naming_the_row_and_the_limit(rewards_file):
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:sleepy", num_workers=1, timeout_s=0.5))
    try:
        with pytest.raises(RewardError, match=r"failed on row 0 .*: did not return within reward.timeout_s=0.5 s; "
                                              r"fix it or set reward.on_error=zero"):
            scorer.score(inputs("a", extra={"sleep": 60}))
    finally:
        scorer.close()


def test_a_worker_that_dies_fails_its_row_and_is_replaced(rewards_file):
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:crashing", num_workers=1, on_error="zero"))
    try:
        (first,) = pids(scorer)
        scores = scorer.score(inputs("ok", "crash", "ok"))
        assert scores.values == [1.0, 0.0, 1.0] and (scores.errors, scores.timeouts) == (1, 0)
        assert pids(scorer) != [first]
    finally:
        scorer.close()
    raising = build_scorer(RewardConfig(fn=f"{rewards_file}:crashing", num_workers=1))
    try:
        with pytest.raises(RewardError, match=r"row 0 .*the reward worker died \(killed by SIGKILL\) during the call"):
            raising.score(inputs("crash"))
    finally:
        raising.close()


def test_a_worker_killed_while_idle_is_replaced_before_its_next_call(rewards_file):
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:crashing", num_workers=1))
    try:
        os.kill(pids(scorer)[0], signal.SIGKILL)
        time.sleep(0.2)
        assert scorer.score(inputs("ok", "ok")).values == [1.0, 1.0]
    finally:
        scorer.close()


def test_workers_hold_no_descriptor_of_the_output_folders_lock(rewards_file, tmp_path):
    with exclusive(tmp_path / "run"):
        scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:lock_descriptors", num_workers=2))
        assert sum(t.endswith(LOCK_FILE) for t in scorer.fn.__globals__["open_files"]()) == 1  # the driver's own
        try:
            scores = scorer.score(inputs("a", "b"))
        finally:
            scorer.close()
    assert [e["lock_fds"] for e in scores.extras] == [0.0, 0.0]
    assert all(e["session"] != os.getsid(0) for e in scores.extras)  # a Ctrl-C at the terminal does not reach them


def test_a_function_the_workers_cannot_load_is_a_config_error_before_scoring(tmp_path):
    path = tmp_path / "driver_only.py"
    path.write_text(f"import os\nif os.getpid() != {os.getpid()}:\n    raise RuntimeError('not here')\n\n"
                    "def score(response, ground_truth):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"^'reward.fn' is '.*driver_only.py:score', but a reward worker could not "
                                          r"load it: ImportError: executing .* failed: RuntimeError: not here"):
        build_scorer(RewardConfig(fn=f"{path}:score", num_workers=1))


DRIVER = """
import sys
from pathlib import Path
from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import RewardInput
from ppo_trainer.rewards.scoring import build_scorer
from ppo_trainer.run.folder import exclusive

fn, out, started = sys.argv[1:]
with exclusive(Path(out)):
    scorer = build_scorer(RewardConfig(fn=fn, num_workers=3, timeout_s=600))
    print(" ".join(str(w.process.pid) for w in scorer.pool.workers), flush=True)
    scorer.score([RewardInput("x", "1", "s", {"sleep": 600, "started": started}, "p")] * 2)  # two busy, one idle
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_worker_outlives_a_sigkilled_driver_and_the_lock_is_free(rewards_file, tmp_path):
    started = tmp_path / "started"
    started.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, f"{rewards_file}:sleepy", str(tmp_path / "run"),
                               str(started)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        deadline = time.monotonic() + 60
        while len(list(started.iterdir())) < 2 and time.monotonic() < deadline:  # two calls hang, one worker idles
            time.sleep(0.05)
        assert len(list(started.iterdir())) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if alive(p)] == []
        with exclusive(tmp_path / "run"):  # the driver's lock went with it; no worker held one
            pass
    finally:
        driver.kill()
        driver.wait()
        for pid in pids if "pids" in locals() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def ends_within(pid: int, seconds: float) -> bool:
    """Whether `pid` stops running within `seconds`."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize(("response", "settings"), [("ok", {}), ("hang", {"timeout_s": 1.0}), ("die", {})],
                         ids=["pool closed", "call timed out", "worker died"])
def test_a_process_a_reward_function_starts_ends_with_its_worker(rewards_file, tmp_path, response, settings):
    pid_file = tmp_path / "child.pid"
    scorer = build_scorer(RewardConfig(fn=f"{rewards_file}:spawning", num_workers=1, on_error="zero", **settings))
    try:
        scores = scorer.score(inputs(response, extra={"pid_file": str(pid_file)}))
        assert scores.errors == (response != "ok")
        child = int(pid_file.read_text())
        if response == "ok":
            assert alive(child)  # the worker still runs: so does what it started, until the pool closes
            scorer.close()
        assert ends_within(child, 5.0)
    finally:
        scorer.close()
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
