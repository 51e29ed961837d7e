"""Small things a user meets at the start of a run: an IPv6 Ray address, an output folder that is
a file, a resume from a `latest` or `best` pointer (as ppo-eval takes them), a dry-run sweep into
a folder of the user's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from ppo_trainer.run import checkpoint
from ppo_trainer.config.composition import compose
from ppo_trainer.config.overrides import normalize_overrides
from ppo_trainer.plan.dry_run import environment_problems
from ppo_trainer.workers.cluster.nodes import ray_address_problem


def ppo_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def ipv6_listener() -> Iterator[int]:
    """The port of a TCP listener on ::1; skips where the machine has no IPv6 loopback."""
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here ({e})")
    with server:
        yield server.getsockname()[1]


def test_a_bracketed_ipv6_ray_address_is_probed_like_an_ipv4_one(ipv6_listener):
    assert ray_address_problem(f"[::1]:{ipv6_listener}") is None


def test_nothing_listening_at_an_ipv6_ray_address_is_named_as_such(ipv6_listener):
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as closed:
        port = closed.getsockname()[1]
    problem = ray_address_problem(f"[::1]:{port}")
    assert problem.startswith(f"devices.ray.address=[::1]:{port}: no Ray cluster answers there (Connection refused)")
    assert f"ray start --head --port={port}" in problem


def test_an_ipv6_ray_address_without_brackets_is_refused_with_the_form_ray_reads():
    assert ray_address_problem("::1:6379") == ("devices.ray.address=::1:6379: an IPv6 address needs brackets, as Ray "
                                               "reads it: devices.ray.address='[::1]:6379'")


def test_a_bracketed_ray_address_on_the_command_line_is_taken_as_a_string():
    assert normalize_overrides(["devices.ray.address=[::1]:6379"]) == ["devices.ray.address='[::1]:6379'"]
    assert normalize_overrides(["devices.ray.address=10.0.0.1:6379"]) == ["devices.ray.address=10.0.0.1:6379"]


def test_an_ipv6_ray_address_passes_the_environment_check_a_run_starts_with(ipv6_listener):
    cfg = compose(["+experiment=smoke", "devices.backend=ray", f"devices.ray.address=[::1]:{ipv6_listener}"])
    assert cfg.devices.ray.address == f"[::1]:{ipv6_listener}"
    assert [p for p in environment_problems(cfg) if "devices.ray.address" in p] == []


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


def fabricated_run(output_dir: Path, steps: tuple[int, ...], best: int) -> Path:
    """Step folders holding the driver's state file, and the `latest` and `best` pointers."""
    for step in steps:
        state = checkpoint.step_dir(output_dir, step) / "state"
        state.mkdir(parents=True)
        (state / "trainer.json").write_text(json.dumps({"step": step}))
    checkpoint.write_pointer(output_dir, "latest", steps[-1])
    checkpoint.write_pointer(output_dir, "best", best)
    return output_dir


@pytest.mark.parametrize("pointer, step", [("latest", 4), ("best", 2)])
def test_resume_from_a_pointer_resumes_the_step_it_names(tmp_path, pointer, step):
    run = fabricated_run(tmp_path / "run", (2, 4), best=2)
    target = checkpoint.resolve_resume(tmp_path / "new", str(run / "checkpoints" / pointer))
    assert target == run / "checkpoints" / f"global_step_{step}"


def test_resume_from_a_run_folder_resumes_its_latest_checkpoint(tmp_path, monkeypatch):
    fabricated_run(tmp_path / "run", (2, 4), best=2)
    monkeypatch.chdir(tmp_path)
    assert checkpoint.resolve_resume(tmp_path / "new", "run") == tmp_path / "run" / "checkpoints" / "global_step_4"


def test_resume_from_a_pointer_naming_a_deleted_step_names_the_pointer_and_the_steps_left(tmp_path):
    run = fabricated_run(tmp_path / "run", (2,), best=2)
    (run / "checkpoints" / "latest").write_text("global_step_6\n")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/latest names 'global_step_6', which is not a "
                                                          r"checkpoint folder; resume from one that exists"):
        checkpoint.resolve_resume(tmp_path / "new", str(run / "checkpoints" / "latest"))


def test_resume_from_a_run_folder_without_checkpoints_says_so(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer.resume=.*run: the run holds no checkpoint yet"):
        checkpoint.resolve_resume(tmp_path / "new", str(tmp_path / "run"))


def test_a_dry_run_sweep_into_a_folder_of_the_users_records_each_plan_in_the_job_folder(tmp_path):
    result = ppo_train("--multirun", "+experiment=smoke", "trainer.dry_run=true", "gae.lam=0.9,0.95",
                       "trainer.output_dir=runs", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lam=0.95" in (tmp_path / "sweep" / "1" / "plan.txt").read_text()
    assert not (tmp_path / "runs").exists(), "a dry run writes no run folder"
