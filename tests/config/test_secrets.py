"""The reward server's bearer token and a URL's credentials never show in what ppo-train writes or
prints: Hydra's launcher lines, its "Error executing job" line, a sweep's multirun.yaml, a job's
overrides.yaml, config.yaml, checkpoints, the dry run. `ppo-train` moves `reward.remote.token=...`
into $PPO_REWARD_TOKEN before Hydra reads the command line; credentials in `reward.remote.url` are
refused (the client never sent them); a token in a config file is masked in every copy we make."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.schema import CONFIG_DIR
from ppo_trainer.config.secrets import mask_secrets
from ppo_trainer.run import folder as run_folder

TOKEN = "tok-7f3a9c1e5b"
PASSWORD = "pw-51d0c2"


def ppo_train(*args: str, cwd: Path, before: str = "", after: str = "",
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`ppo-train ARGS` in a subprocess; `before` and `after` are Python lines run around it."""
    code = (f"import os, sys\n{before}\nfrom ppo_trainer.cli import train_main\n"
            f"try:\n    train_main(sys.argv[1:])\nfinally:\n    {after or 'pass'}\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def holders(secret: str, result: subprocess.CompletedProcess, root: Path) -> list[str]:
    """Where `secret` shows: "stdout", "stderr", and every file under `root` that holds it."""
    printed = [name for name, text in (("stdout", result.stdout), ("stderr", result.stderr)) if secret in text]
    return printed + [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
                      if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_command_line_token_shows_in_no_launcher_line_plan_or_file_of_a_dry_run_sweep(tmp_path):
    result = ppo_train("--multirun", "+experiment=smoke", "trainer.dry_run=true", f"reward.remote.token={TOKEN}",
                       "gae.lam=0.9,0.95", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Launching 2 jobs" in result.stderr and result.stdout.count("# plan") == 2
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    assert holders(TOKEN, result, tmp_path) == []


def test_a_failing_sweep_job_names_its_overrides_without_the_token(tmp_path):
    """The job fails after writing overrides.yaml (dtype_summary made to raise), so Hydra prints its
    "Error executing job with overrides: [...]" line."""
    boom = "import ppo_trainer.plan.dry_run as plan\nplan.dtype_summary = lambda cfg: 1 / 0"
    result = ppo_train("--multirun", "+experiment=smoke", f"reward.remote.token={TOKEN}", "gae.lam=0.9",
                       "hydra.sweep.dir=sweep", cwd=tmp_path, before=boom)
    assert result.returncode == 1
    assert "Error executing job with overrides: ['+experiment=smoke', 'gae.lam=0.9']" in result.stderr
    assert OmegaConf.load(tmp_path / "sweep" / "0" / "overrides.yaml") == ["+experiment=smoke", "gae.lam=0.9"]
    assert holders(TOKEN, result, tmp_path) == []


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--help"]], ids=["cfg", "help"])
def test_hydras_printed_config_shows_no_command_line_token(tmp_path, flags):
    result = ppo_train(*flags, "+experiment=smoke", f"reward.remote.token={TOKEN}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "remote:\n    url: null\n    coef: 1.0\n    token: null\n" in result.stdout
    assert holders(TOKEN, result, tmp_path) == []


def test_a_token_swept_over_several_values_is_refused_with_exit_2_before_anything_is_written(tmp_path):
    result = ppo_train("--multirun", "+experiment=smoke", "trainer.dry_run=true",
                       f"reward.remote.token={TOKEN}-a,{TOKEN}-b", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ppo-train: config error: reward.remote.token is swept over several values")
    assert len(result.stderr.strip().splitlines()) == 1
    assert holders(TOKEN, result, tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_base64_token_hydra_cannot_parse_goes_whole_into_the_environment(tmp_path):
    token = TOKEN + "+/x=="  # '=' and '/' of base64: Hydra's override grammar refuses them unquoted
    check = f"print('moved:', os.environ.get('PPO_REWARD_TOKEN') == {token!r})"
    result = ppo_train("+experiment=smoke", "trainer.dry_run=true", f"reward.remote.token={token}", cwd=tmp_path,
                       after=check)
    assert result.returncode == 0, result.stderr
    assert "moved: True" in result.stdout
    assert holders(TOKEN, result, tmp_path) == []


@pytest.mark.parametrize("override, moved", [
    ("reward.remote.token=abc", "abc"), ("++reward.remote.token='a,b c'", "a,b c"), ("reward.remote.token=0123", "0123"),
    ("reward.remote.token=12345", "12345"), ("reward.remote.token=a~b#c&d", "a~b#c&d"),
    ("reward.remote.token=${oc.env:REWARD_TOKEN}", None), ("reward.remote.token=null", None),
    ("reward.remote.token=", None), ("reward.remote.url=http://h/x", None),
])
def test_only_a_literal_token_override_moves_into_the_environment(override, moved):
    from ppo_trainer.cli import move_token_to_environment

    environ: dict[str, str] = {}
    kept = move_token_to_environment(["gae.lam=0.9", override], environ)
    assert environ == ({"PPO_REWARD_TOKEN": moved} if moved else {})
    assert kept == (["gae.lam=0.9"] if moved else ["gae.lam=0.9", override])


@pytest.mark.parametrize("sweep", [[], ["--multirun", "gae.lam=0.9,0.95"]], ids=["run", "sweep"])
def test_credentials_in_the_reward_url_are_refused_in_one_line_that_masks_them(tmp_path, sweep):
    url = f"http://user:{PASSWORD}@127.0.0.1:9/get_reward"
    result = ppo_train(*sweep, "+experiment=smoke", "trainer.dry_run=true", f"reward.remote.url={url}",
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ppo-train: config error: reward.remote.url=http://***@127.0.0.1:9/get_reward "
                                    "holds credentials")
    assert "PPO_REWARD_TOKEN" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert holders(PASSWORD, result, tmp_path) == [] and list(tmp_path.iterdir()) == []


@pytest.fixture
def config_dir_with_a_token(tmp_path_factory) -> Path:
    """A copy of configs/ with experiment/secret_run.yaml: the smoke experiment with a token written in."""
    configs = tmp_path_factory.mktemp("user") / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    smoke = (configs / "experiment" / "smoke.yaml").read_text()
    (configs / "experiment" / "secret_run.yaml").write_text(f"{smoke}\nreward:\n  remote:\n    token: {TOKEN}\n")
    return configs


def test_a_token_written_in_a_config_file_stays_there_and_in_no_file_hydra_writes(tmp_path, config_dir_with_a_token):
    use_copy = f"import ppo_trainer.config.schema as c, pathlib\nc.CONFIG_DIR = pathlib.Path({str(config_dir_with_a_token)!r})"
    result = ppo_train("--multirun", "+experiment=secret_run", "trainer.dry_run=true", "gae.lam=0.9,0.95",
                       "hydra.sweep.dir=sweep", "hydra.output_subdir=.hydra", cwd=tmp_path, before=use_copy)
    assert result.returncode == 0, result.stderr
    sweep = tmp_path / "sweep"
    assert OmegaConf.load(sweep / "multirun.yaml").reward.remote.token == "***"
    assert OmegaConf.load(sweep / "1" / ".hydra" / "config.yaml").reward.remote.token == "***"
    assert holders(TOKEN, result, tmp_path) == []
    assert TOKEN in (config_dir_with_a_token / "experiment" / "secret_run.yaml").read_text()


def test_url_credentials_and_tokens_are_masked_in_a_written_config(tmp_path):
    cfg = OmegaConf.create({"reward": {"remote": {"url": f"https://user:{PASSWORD}@host:5000/get_reward",
                                                  "token": TOKEN}},
                            "model": {"path": "outputs/x"}, "data": {"val_files": [f"https://{PASSWORD}@hub/x.jsonl"]}})
    run_folder.write_config(tmp_path, cfg)
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.reward.remote == {"url": "https://***@host:5000/get_reward", "token": "***"}
    assert saved.model.path == "outputs/x" and saved.data.val_files == ["https://***@hub/x.jsonl"]


def test_mask_secrets_leaves_strings_that_are_not_urls_with_credentials_alone():
    values = {"a": "user@example.com", "b": "git@github.com:org/repo", "c": "http://[::1", "d": "https://host/x@y"}
    assert mask_secrets(values) == values


class _RewardServer(http.server.ThreadingHTTPServer):
    """A loopback reward server that scores every row 0 and records each request's Authorization."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.authorizations: list[tuple[str, str]] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _RewardServer

    def do_GET(self) -> None:  # noqa: N802  (a start probe)
        self.server.authorizations.append(("GET", self.headers.get("Authorization", "")))
        self._answer({})

    def do_POST(self) -> None:  # noqa: N802
        self.server.authorizations.append(("POST", self.headers.get("Authorization", "")))
        rows = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
        self._answer({"rewards": [0.0] * rows})

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def reward_server() -> Iterator[_RewardServer]:
    server = _RewardServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_command_line_token_reaches_the_reward_server_and_no_file_of_the_run(tmp_path, reward_server):
    url = f"http://127.0.0.1:{reward_server.server_port}/get_reward"
    env = {k: v for k, v in os.environ.items() if k != "PPO_REWARD_TOKEN"}
    result = ppo_train("+experiment=smoke", "trainer.total_steps=2", "trainer.loggers=[console,jsonl]",
                       f"reward.remote.url={url}", f"reward.remote.token={TOKEN}", "trainer.output_dir=run",
                       cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    posts = [auth for method, auth in reward_server.authorizations if method == "POST"]
    assert posts and set(posts) == {f"Bearer {TOKEN}"}
    assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "state" / "config.yaml").is_file()
    assert holders(TOKEN, result, tmp_path) == []
