"""Shared fixtures and the test environment: offline hub, caches and temp files in a throw-away folder.

The converted embedded model (`embedded:smollm2-135m-instruct`, ~30 s to convert) stays in the
default cache dir (`$PPO_TRAINER_CACHE` or `~/.cache/ppo-trainer`), so a machine converts it once.
Everything else (Hugging Face cache, vLLM cache, temp files and sockets, Ray auth) lives in a
folder that is removed when the session ends. The variables are set here, at import, before any
test module imports huggingface_hub, datasets or vLLM, which read them once.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SCRATCH = Path(tempfile.mkdtemp(prefix="ppo-trainer-tests-"))
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
(_SCRATCH / "tmp").mkdir()

os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    HF_HOME=str(_SCRATCH / "hf"),
    TOKENIZERS_PARALLELISM="false",
    RAY_AUTH_MODE="disabled",
    VLLM_CACHE_ROOT=str(_SCRATCH / "vllm"),
    TMPDIR=str(_SCRATCH / "tmp"),
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO_ROOT / ".." / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model and its character tokenizer (seed 0), built once per session."""
    from ppo_trainer.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The shared GSM8K jsonl files (train.jsonl, test.jsonl); skips the test where they are absent."""
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K_DIR.resolve()}")
    return GSM8K_DIR.resolve()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for the whole session: the test models are tiny, and on a busy 2-core
    machine two spinning OpenMP threads make every op up to 10x slower than one. Session scope, so
    module-scoped runs (e.g. the uninterrupted run a resume is compared with) use it too:
    results are bit-identical only at equal thread counts."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def load_script():
    """`load_script("bench_step")`: scripts/bench_step.py imported as a module (registered in
    sys.modules under its name: its dataclasses look their module up there)."""
    import importlib.util
    import sys

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def no_model_loading(monkeypatch, tmp_path):
    """The test fails if a model is about to load (the error it expects must come earlier); it runs
    in its tmp_path."""
    def fail(*_args, **_kwargs):
        raise AssertionError("a model was about to load: the error must come earlier")

    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", fail)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def ppo_train_error(capsys):
    """`ppo_train_error(*overrides)`: `ppo-train +experiment=smoke ...` in this process; asserts exit
    code 2 and one line on stderr, and returns that line."""
    from ppo_trainer.cli import train_main

    def run(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            train_main(["+experiment=smoke", *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    return run


@pytest.fixture
def serve_on_loopback():
    """`serve(server)`: an HTTP server already bound to 127.0.0.1 (port 0: a free one) runs in a
    daemon thread until the test ends; returns its `/get_reward` URL."""
    import threading

    servers = []

    def serve(server) -> str:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/get_reward"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def assert_resumed_like():
    """`assert_resumed_like(uninterrupted_dir, resumed_dir, steps)`: the resumed run's metrics.jsonl
    has every step 0..max(steps) and, at `steps`, the uninterrupted run's metrics exactly (timings
    and memory aside)."""
    import json

    def read(output_dir: Path) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}

    def check(uninterrupted: Path, resumed: Path, steps: tuple[int, ...]) -> None:
        expected, got = read(uninterrupted), read(resumed)
        assert sorted(got) == list(range(max(steps) + 1))
        for step in steps:
            keys = {k for k in expected[step] if not k.startswith(("timing_s/", "perf/"))}
            assert keys == {k for k in got[step] if not k.startswith(("timing_s/", "perf/"))}
            for key in keys:
                assert got[step][key] == expected[step][key], f"step {step} {key}"

    return check
