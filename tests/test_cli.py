"""`ppo-train` as a user runs it: exit codes, dry-run plan, multirun (one subprocess per case)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def ppo_train(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)


def test_dry_run_prints_the_plan_with_overrides_and_exits_0(tmp_path):
    result = ppo_train("+experiment=gsm8k", "trainer.dry_run=true", "gae.lam=0.9", "sampler.n=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "lam=0.9" in out and "n=4" in out
    assert "sequences per step: 1024" in out  # 256 prompts x 4 samples
    assert "optimizer steps per ppo step: 4" in out  # 256 / 64 mini-batches, 1 epoch
    assert "data:      train from openai/gsm8k[train] from the hub; val from openai/gsm8k[test] from the hub" in out
    assert not (tmp_path / "outputs").exists(), "a dry run must leave nothing behind"


@pytest.mark.parametrize("override", ["gae.gama=0.9", "+gae.gama=0.9"])
def test_unknown_key_exits_2_naming_the_key(tmp_path, override):
    result = ppo_train("+experiment=gsm8k", "trainer.dry_run=true", override, cwd=tmp_path)
    assert result.returncode == 2
    assert "gae.gama" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("override", ["critic.lr=1e-5", "+critic.lr=1e-5"])
def test_a_flat_critic_optimizer_key_exits_2_naming_its_new_place(tmp_path, override):
    result = ppo_train("+experiment=smoke", "trainer.dry_run=true", override, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ppo-train: config error: unknown config key 'critic.lr': 'critic.lr' moved to 'critic.optim.lr' (verl's "
        "spelling, like the actor's model.optim); write critic.optim.lr=...")


def test_an_option_for_a_section_without_options_exits_2_naming_the_groups_that_have_them(tmp_path):
    result = ppo_train("trainer.dry_run=true", "critic=default", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ppo-train: config error: unknown option 'critic=default'; 'critic' has no options (the groups with options: "
        "data, devices, model, sampler); set its keys instead, e.g. critic.path=...")


def test_malformed_override_exits_2(tmp_path):
    result = ppo_train("trainer.dry_run=true", "gae.lam=[1", cwd=tmp_path)
    assert result.returncode == 2


def test_multirun_makes_one_run_directory_per_value(tmp_path):
    result = ppo_train("--multirun", "+experiment=gsm8k", "trainer.dry_run=true", "gae.lam=0.9,0.95",
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("# plan") == 2
    assert "lam: 0.9\n" in result.stdout and "lam: 0.95\n" in result.stdout
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    assert "lam=0.95" in (tmp_path / "sweep" / "1" / "plan.txt").read_text()


@pytest.mark.parametrize("flags, expected, absent", [
    (["--cfg", "job"], "gae:\n", "hydra:\n"),
    (["-c", "job"], "gae:\n", "hydra:\n"),
    (["--cfg", "hydra"], "hydra:\n", "gae:\n"),
    (["--cfg", "job", "--package", "gae"], "# @package gae\n", "trainer:"),
])
def test_hydra_cfg_flags_print_the_config_and_run_nothing(tmp_path, flags, expected, absent):
    result = ppo_train("+experiment=gsm8k", *flags, "gae.lam=0.9", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout and absent not in result.stdout
    if "hydra" not in flags:
        assert "lam: 0.9\n" in result.stdout
    assert not (tmp_path / "outputs").exists()


def test_hydra_info_flag_describes_the_app(tmp_path):
    result = ppo_train("+experiment=gsm8k", "--info", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Config search path" in result.stdout


def test_hydra_info_prints_each_line_once_on_stdout(tmp_path):
    result = ppo_train("--info", "searchpath", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Config search path") == 1 and result.stderr == ""


@pytest.mark.parametrize("flag, expected", [("--help", "ppo-train is powered by Hydra"),
                                            ("--hydra-help", "--shell-completion")])
def test_help_flags_describe_the_app(tmp_path, flag, expected):
    result = ppo_train(flag, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    if flag == "--help":
        groups = result.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
        # rm_experiment is ppo-train-rm's (the two share configs/; ppo-train refuses its keys, exit 2)
        assert [line.split(":")[0] for line in groups.splitlines()[2:] if line] == [
            "data", "devices", "experiment", "model", "rm_experiment", "sampler", "sweep"]
        assert "experiment: calculator_cpu, digits, digits_reveal, gsm8k, gsm8k_cpu, rlhf_cpu, smoke" in groups


def test_shell_completion_installs_and_completes_keys_and_options(tmp_path):
    script = ppo_train("--shell-completion", "install=bash", cwd=tmp_path)
    assert script.returncode == 0 and "hydra_bash_completion" in script.stdout
    for line, completion in [("ppo-train gae.la", "gae.lam_mode="), ("ppo-train +experiment=", "+experiment=smoke")]:
        query = ppo_train("-sc", "query=bash", cwd=tmp_path, env={**os.environ, "COMP_LINE": line})
        assert completion in query.stdout.split(), query.stderr


def test_hydra_flags_do_not_hide_a_bad_override(tmp_path):
    result = ppo_train("--cfg", "job", "gae.gama=0.9", cwd=tmp_path)
    assert result.returncode == 2
    assert "gae.gama" in result.stderr


def test_short_multirun_flag_sweeps(tmp_path):
    result = ppo_train("-m", "+experiment=smoke", "trainer.dry_run=true", "gae.lam=0.9,0.95", "hydra.sweep.dir=sweep",
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]


def ppo_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from ppo_trainer.cli import eval_main; eval_main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arg, message", [("--limit=4", "unrecognized arguments: --limit=4"),
                                          ("eval.limit", "'eval.limit' is not a key=value override")])
def test_ppo_eval_rejects_an_argument_it_does_not_understand(tmp_path, arg, message):
    result = ppo_eval("model.path=random:tiny", arg, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_ppo_eval_help_lists_the_model_path_forms(tmp_path):
    result = ppo_eval("--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "checkpoints/latest" in result.stdout


@pytest.mark.parametrize("output_dir", ["taken", "taken/run"])
@pytest.mark.parametrize("sweep", [[], ["--multirun", "gae.lam=0.9,0.95", "hydra.sweep.dir=sweep"]],
                         ids=["run", "sweep"])
def test_an_output_dir_that_is_a_file_exits_2_in_one_line_naming_the_key_and_the_file(tmp_path, output_dir, sweep):
    (tmp_path / "taken").write_text("a file of the user's\n")
    result = ppo_train(*sweep, "+experiment=smoke", f"trainer.output_dir={output_dir}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == (3 if sweep else 1)  # a sweep: Hydra's "Launching" and "#0" lines first
    assert lines[-1] == (f"ppo-train: config error: trainer.output_dir={output_dir}: {tmp_path / 'taken'} is a file, "
                         "not a folder; choose another trainer.output_dir, or move the file away")
    assert (tmp_path / "taken").read_text() == "a file of the user's\n"


def test_an_output_dir_that_is_a_file_is_refused_before_hydra_writes_anything(tmp_path):
    (tmp_path / "taken").write_text("")
    result = ppo_train("+experiment=smoke", "trainer.output_dir=taken", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_dry_run_sweep_into_a_folder_of_the_users_records_each_plan_in_the_job_folder(tmp_path):
    result = ppo_train("--multirun", "+experiment=smoke", "trainer.dry_run=true", "gae.lam=0.9,0.95",
                       "trainer.output_dir=runs", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lam=0.95" in (tmp_path / "sweep" / "1" / "plan.txt").read_text()
    assert not (tmp_path / "runs").exists(), "a dry run writes no run folder"


def test_ppo_eval_help_says_what_eval_n_does_and_where_the_responses_go(tmp_path):
    result = ppo_eval("--help", cwd=tmp_path)
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "greedy decoding by default; eval.n=N samples N responses per prompt at eval.temperature" in text
    assert "mean@N and pass@N" in text and "Greedy accuracy" not in text
    assert "a checkpoint's into <run>/eval/global_step_N.jsonl, any other model's into eval.jsonl here" in text


@pytest.mark.parametrize("output_file, checkpoint, index, count, expected", [
    (None, True, 0, 1, "/runs/a/eval/global_step_7.jsonl"),  # a checkpoint: its run's eval/ folder
    (None, True, 1, 2, "/runs/a/eval/global_step_7.jsonl"),  # named by its step, among several too
    (None, False, 0, 1, "eval.jsonl"),  # any other model: the current folder
    (None, False, 1, 2, "eval.1.jsonl"),
    ("out/e.jsonl", True, 0, 1, "out/e.jsonl"),  # eval.output_file wins
    ("out/e.jsonl", False, 1, 2, "out/e.1.jsonl"),
])
def test_ppo_eval_writes_a_checkpoints_responses_into_its_run_and_any_other_models_here(output_file, checkpoint, index,
                                                                                       count, expected):
    from ppo_trainer.cli import eval_output_file

    run_config = Path("/runs/a/checkpoints/global_step_7/state/config.yaml") if checkpoint else None
    assert eval_output_file(output_file, run_config, 7 if checkpoint else None, index, count) == Path(expected)
