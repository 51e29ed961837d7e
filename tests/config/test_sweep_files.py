"""The sweep files in configs/sweep/ and how `ppo-train` checks a sweep before Hydra runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from omegaconf import OmegaConf

from ppo_trainer import cli
from ppo_trainer.config import composition, overrides
from ppo_trainer.config.schema import CONFIG_DIR, ConfigError, group_options

SWEEPS = group_options("sweep")


def test_there_are_grid_and_optuna_examples():
    assert {"kl_and_lambda", "learning_rates", "optuna_smoke"} <= set(SWEEPS)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_is_global_and_starts_with_its_command(name):
    lines = (CONFIG_DIR / "sweep" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# ppo-train --multirun +experiment=") and lines[1].endswith(f" +sweep={name}")


LR_SWEEPS = [(name, key) for name in SWEEPS for key in overrides.sweep_file(name)[1] if key.split(".")[-1] == "lr"]


def test_some_sweep_files_sweep_a_learning_rate():
    assert {name for name, _ in LR_SWEEPS} >= {"learning_rates", "optuna_smoke"}


@pytest.mark.parametrize("name,key", LR_SWEEPS, ids=[f"{n}:{k}" for n, k in LR_SWEEPS])
def test_a_swept_learning_rate_brackets_the_value_of_the_recipe_the_file_names(name, key):
    """Within 10x either side of the recipe's own value: a CPU recipe swept with a GPU recipe's
    learning rates (50-200x too low) spent its whole sweep on runs that barely move."""
    header = (CONFIG_DIR / "sweep" / f"{name}.yaml").read_text().splitlines()[1]
    experiment = re.search(r"\+experiment=(\S+)", header).group(1)
    recipe_value = OmegaConf.select(composition.compose([f"+experiment={experiment}"]), key)
    override = OverridesParser.create().parse_overrides([f"{key}={overrides.sweep_file(name)[1][key]}"])[0]
    sweep = override.value()
    values = [sweep.start, sweep.end] if isinstance(sweep, IntervalSweep) else list(override.sweep_iterator())
    assert min(values) <= recipe_value <= max(values), (experiment, recipe_value, values)
    assert recipe_value / 10 <= min(values) and max(values) <= recipe_value * 10, (experiment, recipe_value, values)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_params_pass_the_schema_checks(name, monkeypatch):
    monkeypatch.setattr(overrides, "installed_sweepers", lambda: {"basic", "optuna"})
    overrides.check_overrides([f"+sweep={name}"])


def test_optuna_sweep_without_the_plugin_exits_2_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(overrides, "installed_sweepers", lambda: {"basic"})
    with pytest.raises(SystemExit) as exit_info:
        cli.train_main(["--multirun", "+experiment=smoke", "+sweep=optuna_smoke"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip install 'ppo-trainer[optuna]'" in err


def test_selecting_an_uninstalled_sweeper_on_the_command_line_is_a_config_error(monkeypatch):
    monkeypatch.setattr(overrides, "installed_sweepers", lambda: {"basic"})
    with pytest.raises(ConfigError, match=r"hydra/sweeper=optuna is not installed: pip install 'ppo-trainer\[optuna\]'"):
        overrides.check_overrides(["hydra/sweeper=optuna", "gae.lam=interval(0.9,1.0)"])


@pytest.mark.parametrize("override", ["gae.lam=interval(0.9,1.0)", "critic.optim.lr=tag(log, interval(1e-4,1e-2))",
                                      "gae.lam=range(0.9,1.0,0.05)", "sampler.n=int(interval(1,4))"])
def test_interval_and_range_sweeps_are_checked_by_their_values(override):
    overrides.check_overrides([override])


def test_a_float_interval_over_an_integer_key_is_a_config_error():
    with pytest.raises(ConfigError, match="sampler.n"):
        overrides.check_overrides(["sampler.n=interval(1,4)"])


def test_unknown_sweep_names_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown option '\+sweep=nope'; available: .*kl_and_lambda"):
        overrides.check_overrides(["+sweep=nope"])


def test_grid_sweep_file_drives_the_multirun(tmp_path: Path):
    """A dry run of every job: the file's 3 KL values x 2 lambdas, one folder each."""
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, "--multirun", "+experiment=gsm8k", "+sweep=kl_and_lambda",
                             "trainer.dry_run=true", "hydra.sweep.dir=sweep"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("# plan") == 6
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == [str(i) for i in range(6)]
    plans = [(tmp_path / "sweep" / str(i) / "plan.txt").read_text() for i in range(6)]
    assert sum("lam=1.0 kl_coef=0.0 " in plan for plan in plans) == 1


def test_a_grid_sweep_value_out_of_range_stops_the_command_before_job_0(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.train_main(["--multirun", "+experiment=smoke", "gae.lam=0.9,2", "critic.optim.lr=1e-3,1e-4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ppo-train: config error: sweep job 2 (gae.lam=2 critic.optim.lr=0.001): 'gae.lam' must be in [0, 1], got 2.0"]
    assert not (tmp_path / "multirun").exists(), "no job ran"


def test_a_sweep_files_values_are_checked_with_the_command_lines_fixed_keys(monkeypatch):
    """kl_and_lambda sweeps gae.lam over values all valid; a command-line key replaces the file's sweep."""
    checked = []
    monkeypatch.setattr(composition, "compose", lambda overrides: checked.append(sorted(overrides)))
    composition.check_grid_sweep(["+experiment=smoke", "+sweep=kl_and_lambda", "gae.kl_coef=0.01"])
    assert checked == [["+experiment=smoke", "gae.kl_coef=0.01", "gae.lam=0.95"],
                       ["+experiment=smoke", "gae.kl_coef=0.01", "gae.lam=1.0"]]
