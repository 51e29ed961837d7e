"""Sweeps as a user runs them: `ppo-train --multirun` over the smoke experiment (one process, jobs
one after another), then `ppo-sweep-report` on the sweep folder."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.sweep_report import main as report_main

SHORT = ["+experiment=smoke", "trainer.total_steps=2", "trainer.val_every=1", "trainer.save_every=0",
         "trainer.loggers=[jsonl]", "hydra.sweep.dir=sweep"]

# After the sweep, in the same process: what the jobs left alive.
_AFTER_SWEEP = """
import gc, json, torch, torch.distributed as dist
gc.collect()
live = [type(m).__name__ for m in gc.get_objects()
        if isinstance(m, torch.nn.Module) and next(m.parameters(), None) is not None]
print("AFTER_SWEEP " + json.dumps({"modules_with_parameters": live,
      "world_size": dist.get_world_size() if dist.is_initialized() else None}))
"""


def multirun(*args: str, cwd: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])\n" + _AFTER_SWEEP
    return subprocess.run([sys.executable, "-c", code, "--multirun", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, dict, str]:
    """Two smoke runs of two steps from the kl_and_lambda sweep file (gae.lam 0.95 and 1.0; the
    command line fixes gae.kl_coef, so the file's three KL values collapse to one); what the
    jobs left alive, and what the sweep printed."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = multirun(*SHORT, "+sweep=kl_and_lambda", "gae.kl_coef=0.01", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("AFTER_SWEEP "))
    return cwd / "sweep", json.loads(line.removeprefix("AFTER_SWEEP ")), result.stdout


def test_each_job_writes_a_complete_run_directory(sweep):
    sweep_dir, _, _ = sweep
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    for job, lam in (("0", 0.95), ("1", 1.0)):
        run = sweep_dir / job
        config = OmegaConf.load(run / "config.yaml")
        assert config.gae.lam == lam and config.gae.kl_coef == 0.01
        assert config.trainer.output_dir == str(run)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all("val/accuracy" in r for r in records)
        assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_2"
        overrides = OmegaConf.to_container(OmegaConf.load(run / "overrides.yaml"))
        assert f"gae.lam={lam}" in overrides and "+sweep=kl_and_lambda" in overrides


def test_jobs_release_their_models_and_the_second_job_reinitialises(sweep):
    """Job 1 built its models in the process job 0 ran in (torch.distributed was initialised
    again or reused), and after the sweep no model of either job is alive."""
    _, after, _ = sweep
    assert after["modules_with_parameters"] == []
    assert after["world_size"] in (None, 1)


def test_the_sweep_ends_naming_its_folder_and_the_report_command(sweep):
    _, _, printed = sweep
    ended = [line for line in printed.splitlines() if not line.startswith("AFTER_SWEEP ")][-1]
    assert ended == "ppo-train: the sweep's runs are in sweep/<job number>; compare them with: ppo-sweep-report sweep"


def test_report_lists_both_runs_with_their_overrides(sweep, capsys):
    sweep_dir, _, _ = sweep
    report_main([str(sweep_dir)])
    printed = capsys.readouterr().out
    markdown = (sweep_dir / "report.md").read_text()
    assert markdown in printed
    assert "+experiment=smoke" in markdown and "+sweep=kl_and_lambda" in markdown  # shared by both runs
    with (sweep_dir / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["gae.lam"] for r in rows) == ["0.95", "1.0"]
    assert sorted(r["job"] for r in rows) == ["0", "1"]
    for row in rows:
        assert row["steps"] == "2/2"
        assert 0.0 <= float(row["val/accuracy final"]) <= float(row["val/accuracy best"]) <= 1.0
        assert float(row["train s"]) > 0
        for column in ("score", "kl", "explained var"):
            float(row[column])  # present and numeric
    assert (sweep_dir / "val_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_optuna_example_runs_three_trials_and_reports_them(tmp_path, capsys):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = multirun(*SHORT, "+sweep=optuna_smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep_dir = tmp_path / "sweep"
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2"]
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert set(best.best_params) == {"gae.lam", "critic.optim.lr"}
    report_main([str(sweep_dir)])
    with (sweep_dir / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert all(0.9 <= float(r["gae.lam"]) <= 1.0 and 1e-4 <= float(r["critic.optim.lr"]) <= 1e-2 for r in rows)
    finals = [float(r["val/accuracy final"]) for r in rows]
    assert finals == sorted(finals, reverse=True)
    assert best.best_value == finals[0]


@pytest.mark.slow
def test_an_optuna_trial_with_invalid_values_scores_the_worst_and_the_search_goes_on(tmp_path):
    """With sampler seed 0, interval(0.9, 1.1) draws gae.lam 1.0098, 1.0206, then 0.9848: two trials
    out of range (scored -inf, not run), the third runs and is the best."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = multirun(*SHORT, "+sweep=optuna_smoke", "gae.lam=interval(0.9,1.1)", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("not run, its values are invalid (scored -inf): 'gae.lam' must be in [0, 1]") == 2
    best = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert best.best_params["gae.lam"] < 1 and best.best_value > float("-inf")


def test_an_optuna_search_minimising_what_the_runs_maximise_exits_2_before_a_trial_trains(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = multirun(*SHORT, "+sweep=optuna_smoke", "hydra.sweeper.direction=minimize", cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("hydra.sweeper.direction=minimize but trainer.objective_direction=maximize" in result.stderr)
    assert not list((tmp_path / "sweep").glob("*/metrics.jsonl"))
