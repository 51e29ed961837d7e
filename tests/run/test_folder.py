"""One run per output folder (a POSIX record lock), the previous run moved aside by
trainer.resume=never, config.yaml before any model, an absolute output path, the W&B run id kept in
the folder, a non-finite KL never saved, and sweep jobs in their own folders."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.cli import train_main
from ppo_trainer.config.composition import compose
from ppo_trainer.errors import NonFiniteError
from ppo_trainer.run import folder as run_folder
from ppo_trainer.tracking import wandb_run_id
from ppo_trainer.trainer import run_training

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]"]

HOLDER = """
import os, sys, time
from pathlib import Path
from ppo_trainer.run.folder import exclusive
with exclusive(Path(sys.argv[1])):
    if sys.argv[2] == "fork" and os.fork() == 0:  # a child forked without exec (vLLM's engine, a reward pool)
        time.sleep(60)
        os._exit(0)
    print("locked", flush=True)
    time.sleep(60)
"""


def hold(folder: Path, mode: str = "plain") -> subprocess.Popen:
    """A process holding `folder`'s run lock (it prints "locked" once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_second_run_on_a_held_folder_exits_2_naming_the_first_and_writes_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    holder = hold(out)
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_main([*SMOKE, f"trainer.output_dir={out}"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid} on host" in err[0] and "started 20" in err[0]
        assert err[0].startswith(f"ppo-train: input error: trainer.output_dir={out} is in use by another run")
        assert sorted(p.name for p in out.iterdir()) == [".run.lock"]  # no engine.log, no config.yaml
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_dies_with_its_holder_even_when_a_forked_child_lives_on(tmp_path):
    """SIGKILL of the driver frees the folder at once, although its forked child still runs (a flock
    would be shared with the child and outlive the driver)."""
    holder = hold(tmp_path, "fork")
    with pytest.raises(run_folder.OutputDirBusy, match=f"pid {holder.pid}"):
        with run_folder.exclusive(tmp_path):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    try:
        with run_folder.exclusive(tmp_path):
            assert (tmp_path / run_folder.LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the orphaned child, same session


def test_the_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    with run_folder.exclusive(tmp_path):
        with run_folder.exclusive(tmp_path):  # the CLI holds it, run_training takes it again
            pass
    holder = hold(tmp_path)  # another process gets it once this one let go
    holder.kill()
    holder.wait()


def test_without_file_locks_a_pid_file_stands_in(tmp_path, monkeypatch, caplog):
    def no_locks(*_args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_folder.fcntl, "lockf", no_locks)
    lock = tmp_path / run_folder.LOCK_FILE
    release = run_folder._lock(lock)
    assert "falling back to a pid file" in caplog.text
    with pytest.raises(run_folder.OutputDirBusy, match=f"pid {os.getpid()}.*if that run is gone, remove the file"):
        run_folder._lock(lock)  # our own pid is alive: held
    release()
    lock.write_text("pid 999999999 on host " + os.uname().nodename + ", started 2026-01-01 00:00:00\n")
    run_folder._lock(lock)()  # a dead holder's file is taken over


def test_resume_never_moves_the_previous_run_aside_and_starts_clean(tmp_path, caplog):
    run_training(compose([*SMOKE, f"trainer.output_dir={tmp_path}", "trainer.total_steps=2"]))
    run_training(compose([*SMOKE, f"trainer.output_dir={tmp_path}", "trainer.total_steps=1", "trainer.save_every=1",
                          "trainer.resume=never"]))
    (aside,) = tmp_path.glob("previous-*")
    assert f"moved the previous run's checkpoints and metrics to {aside}" in caplog.text
    assert (aside / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    assert sorted(metrics(aside)) == [0, 1, 2] and sorted(metrics(tmp_path)) == [0, 1]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_1"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "best", "commit_order", "global_step_1", "latest"]


def test_config_yaml_is_written_before_any_model_loads_and_the_output_dir_is_absolute(tmp_path, monkeypatch):
    seen = {}

    def build_groups(cfg, *_args):
        seen["config"] = OmegaConf.load(Path(cfg.trainer.output_dir) / "config.yaml")
        raise RuntimeError("stop before the models")

    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", build_groups)
    monkeypatch.chdir(tmp_path)
    cfg = compose([*SMOKE, "trainer.output_dir=relative/run"])
    with pytest.raises(RuntimeError, match="stop before the models"):
        run_training(cfg)
    assert cfg.trainer.output_dir == str(tmp_path / "relative" / "run")
    assert seen["config"].trainer.output_dir == str(tmp_path / "relative" / "run")
    assert not list((tmp_path / "relative" / "run").glob(".*.tmp"))


def test_the_wandb_run_id_is_made_once_per_folder(tmp_path):
    first = wandb_run_id(tmp_path)
    assert len(first) == 16 and wandb_run_id(tmp_path) == first, "a resume logs into the same run"
    (tmp_path / "other").mkdir()
    assert wandb_run_id(tmp_path / "other") != first, "another folder, another run (the same path elsewhere too)"


def test_a_non_finite_kl_is_ignored_by_the_adaptive_controller_and_never_saved(tmp_path, monkeypatch, caplog):
    import ppo_trainer.core.advantages as advantages_module

    real = advantages_module.compute
    monkeypatch.setattr(advantages_module, "compute",
                        lambda *a, **k: real(*a, **k)._replace(sequence_kl=float("nan")))
    overrides = [*SMOKE, f"trainer.output_dir={tmp_path}", "gae.kl_ctrl=adaptive", "trainer.save_every=1",
                 "trainer.max_skipped_steps=2"]
    with pytest.raises(NonFiniteError, match="kl_ctrl: non-finite updates in 2 PPO steps in a row.*global_step_1"):
        run_training(compose(overrides))
    assert "the adaptive controller ignored it (coefficient stays 0.001)" in caplog.text
    assert metrics(tmp_path)[1]["kl_ctrl/skipped_updates"] == 1.0
    state = json.loads((tmp_path / "checkpoints" / "global_step_1" / "state" / "trainer.json").read_text())
    assert state["kl_ctrl"] == {"value": 0.001} and state["nonfinite_streak"]["kl_ctrl"] == 1


@pytest.mark.slow
def test_a_sweep_with_a_fixed_output_dir_trains_every_job_in_its_own_folder(tmp_path):
    out = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])",
         "--multirun", *SMOKE, "trainer.total_steps=2", f"trainer.output_dir={out}", "gae.lam=0.9,1.0"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    for job, lam in (("0", 0.9), ("1", 1.0)):
        assert sorted(metrics(out / job)) == [0, 1, 2], f"job {job} trained"
        assert OmegaConf.load(out / job / "config.yaml").gae.lam == lam
    report = subprocess.run([sys.executable, "-c", "from ppo_trainer.sweep_report import main; main()", str(out)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert report.returncode == 0 and "gae.lam" in report.stdout, report.stderr


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_the_rerun_gets_the_room_back(tmp_path, monkeypatch):
    from ppo_trainer.engine.fsdp import FSDPEngine
    from ppo_trainer.run.checkpoint import CheckpointSaveError

    real_save = FSDPEngine.save_state

    def save_state(engine, folder):
        if "global_step_2" in str(folder):
            (Path(folder) / "partial.distcp").parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / "partial.distcp").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(engine, folder)

    monkeypatch.setattr(FSDPEngine, "save_state", save_state)
    overrides = [*SMOKE, f"trainer.output_dir={tmp_path}", "trainer.total_steps=3", "trainer.save_every=1"]
    with pytest.raises(CheckpointSaveError, match=r"saving step 2 failed .*No space left.*free the disk.*global_step_1: rerun"):
        run_training(compose(overrides))
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step_1"
    assert (checkpoints / ".incomplete_global_step_2" / "state" / "actor" / "partial.distcp").is_file()
    monkeypatch.setattr(FSDPEngine, "save_state", real_save)
    run_training(compose(overrides))
    assert not list(checkpoints.glob(".incomplete_*")) and (checkpoints / "latest").read_text().strip() == "global_step_3"
    assert sorted(metrics(tmp_path)) == [0, 1, 2, 3]


@pytest.mark.parametrize("accelerator, colocate, released", [("cuda", True, True), ("cuda", False, False),
                                                              ("cpu", True, False)])
def test_trainers_release_cached_memory_before_a_colocated_engine_wakes(accelerator, colocate, released):
    from types import SimpleNamespace

    from ppo_trainer.trainer import Trainer

    calls = []
    group = lambda name: SimpleNamespace(run_all=lambda method, *a, **k: calls.append((name, method.__name__)))  # noqa: E731
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = OmegaConf.create({"devices": {"colocate": colocate, "accelerator": accelerator},
                                    "sampler": {"max_staleness": 0}})
    trainer.actor, trainer.critic, trainer.rollout = group("actor"), group("critic"), group("rollout")
    with trainer.rollout_awake():
        pass
    expected = [("actor", "release_memory"), ("critic", "release_memory")] if released else []
    assert calls == [*expected, ("rollout", "wake"), ("rollout", "sleep")]
    calls.clear()
    trainer.cfg.sampler.max_staleness = 1  # generating ahead: a sleep call would wait for that generation
    with trainer.rollout_awake():
        pass
    assert calls == []


def test_the_rollout_sleeps_after_a_validation_that_fails_and_the_failure_is_the_one_raised():
    """A colocated vLLM engine left awake after a failed call would keep its weights and KV cache in
    the memory the trainers need next."""
    from types import SimpleNamespace

    from ppo_trainer.data import PromptRecord
    from ppo_trainer.trainer import Trainer
    from ppo_trainer.workers.roles import WorkerError

    calls = []

    def run_split(method, *args, **kwargs):
        raise WorkerError("rollout worker rank 0 of 1 failed in generate: RuntimeError: out of memory")

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = compose(["+experiment=smoke", "eval.save_generations=false"])
    trainer.rollout = SimpleNamespace(run_all=lambda method, *a, **k: calls.append(method.__name__),
                                      run_split=run_split)
    trainer.step, trainer.pad_id, trainer.val_scorer = 0, 0, None
    trainer.val_records = [PromptRecord(0, "1+1?", "1+1?", (1, 2, 3), "2", "arithmetic")]
    with pytest.raises(WorkerError, match="out of memory"):
        trainer.validate()
    assert calls == ["wake", "sleep"]
