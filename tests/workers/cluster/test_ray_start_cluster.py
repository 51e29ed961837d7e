"""A Ray cluster as users start it (slow): `ray start --head` in one folder, a second node started in
another, and `ppo-train` launched from a third folder with the default, relative output folder and
a relative model.path. Ray workers run in their node's `ray start` folder, not the driver's: the run
must still write complete checkpoints into the driver's folder and resume exactly, and the dry
run's cluster check must pass there (and name a node whose torch differs).

Everything binds 127.0.0.1. Ray's CLI refuses a non-head node when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
(the setting that keeps a node on loopback) and otherwise rewrites 127.0.0.1 to the machine's outward
address, so the second node is started by the same CLI with that rewrite turned off. The cluster is
stopped by killing its own processes (`ray stop` would end every Ray on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[3]
RAY = str(Path(sys.executable).with_name("ray"))
TRAIN = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
START_NODE = ("import sys, ray._private.services as services; services.resolve_ip_for_localhost = lambda host: host; "
              "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()")
# A driver whose job gives the workers of one node another torch (a runtime-env setup hook, shipped by value).
OTHER_TORCH = """
import sys, ray
def hook(node=sys.argv[2]):  # a default: the hook runs in the workers, whose sys.argv is their own
    import ray
    from ppo_trainer.workers.cluster import nodes as cluster
    if ray.get_runtime_context().get_node_id() == node:
        found = cluster.package_versions
        cluster.package_versions = lambda packages=cluster.PACKAGES: {**found(packages), "torch": "2.12.1+cpu"}
ray.init(address=sys.argv[1], runtime_env={"worker_process_setup_hook": hook})
from ppo_trainer.cli import train_main
train_main(sys.argv[3:])
"""
NODE_CPUS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_processes(marks: list[str]) -> set[int]:
    """Processes whose command line holds one of `marks` (the nodes' temp folders, the GCS address),
    and all their descendants (the workers)."""
    parents: dict[int, int] = {}
    roots = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if any(mark in command for mark in marks):
            roots.add(int(entry))
    found, grew = set(roots), True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return found


def kill_cluster(marks: list[str]) -> None:
    for _ in range(3):  # a dying raylet may still start a worker
        for pid in cluster_processes(marks):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "VLLM_HOST_IP": "127.0.0.1",
            "OMP_NUM_THREADS": "1", **extra}


def ray_start(folder: Path, *args: str, code: str | None = None, **extra: str) -> None:
    command = [sys.executable, "-c", code, "start"] if code else [RAY, "start"]
    common = [f"--num-cpus={NODE_CPUS}", "--disable-usage-stats", "--object-store-memory=200000000",
              f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    result = subprocess.run([*command, *args, *common], cwd=folder, env=env(**extra), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, str | Path]]:
    """{"address", "root", "node_b"}: the head started in root/head, the second node in root/node."""
    root = tmp_path_factory.mktemp("ray-start")
    temps = [tempfile.mkdtemp(prefix="rs-", dir="/tmp") for _ in range(2)]  # short: socket paths are limited
    port = free_port()
    address = f"127.0.0.1:{port}"
    marks = [*temps, address]
    try:
        (root / "head").mkdir()
        (root / "node").mkdir()
        ray_start(root / "head", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                  f"--ray-client-server-port={free_port()}", f"--temp-dir={temps[0]}",
                  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        ray_start(root / "node", f"--address={address}", "--node-ip-address=127.0.0.1", f"--temp-dir={temps[1]}",
                  code=START_NODE)
        nodes = subprocess.run(
            [sys.executable, "-c", "import sys, time, ray\nray.init(address=sys.argv[1])\n"
             "for _ in range(60):\n    alive = [n for n in ray.nodes() if n['Alive']]\n    if len(alive) == 2: break\n"
             "    time.sleep(1)\nprint(*[n['NodeID'] for n in alive if n['NodeManagerAddress'] == '127.0.0.1'"
             " and not n['Resources'].get('node:__internal_head__')])", address],
            env=env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"), capture_output=True, text=True, timeout=120)
        assert nodes.returncode == 0 and len(nodes.stdout.split()) == 1, nodes.stderr[-2000:]
        yield {"address": address, "root": root, "node_b": nodes.stdout.split()[0]}
    finally:
        kill_cluster(marks)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)


def run_args(address: str) -> list[str]:
    """The smoke experiment on the cluster: 2 actor ranks on one node, critic and rollout on the other;
    the output folder is the default outputs/smoke, relative to the folder ppo-train starts in. The
    reward (the share of digits in a response, a module in that folder: the driver scores) varies
    between samples, so the updates move and an exact resume means something."""
    return ["+experiment=smoke", "model.path=models/tiny", "reward.fn=digit_share:reward", "devices.backend=ray",
            "devices.accelerator=cpu", "devices.colocate=false", "devices.devices_per_node=2",
            "devices.actor.num_devices=2", f"devices.ray.address={address}", "trainer.save_every=1",
            "trainer.loggers=[console,jsonl]"]


def ppo_train(folder: Path, *args: str, code: str = TRAIN, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *extra, *args], cwd=folder,
                          env=env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"), capture_output=True, text=True, timeout=900)


def launch_folder(root: Path, name: str, tiny_model_dir: Path) -> Path:
    """A folder to start ppo-train from, with the tiny model at models/tiny (a path relative to it) and
    the reward module digit_share.py."""
    folder = root / name
    shutil.copytree(tiny_model_dir, folder / "models" / "tiny")
    (folder / "digit_share.py").write_text(
        "def reward(response, ground_truth):\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n")
    return folder


def metrics(output_dir: Path) -> dict[int, dict]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records}


def test_a_run_launched_from_a_third_folder_checkpoints_there_and_resumes_exactly(cluster, tiny_model_dir):
    root, args = cluster["root"], run_args(cluster["address"])
    interrupted = launch_folder(root, "driver", tiny_model_dir)
    first = ppo_train(interrupted, *args, "trainer.stop_after_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = ppo_train(interrupted, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from outputs/smoke/checkpoints/global_step_2 (step 2)" in resumed.stderr + resumed.stdout
    once = launch_folder(root, "uninterrupted", tiny_model_dir)
    whole = ppo_train(once, *args)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out = interrupted / "outputs" / "smoke"
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step_4"
    for step in (3, 4):  # keep_last=2
        folder = checkpoints / f"global_step_{step}"
        assert sorted(p.name for p in (folder / "manifest").iterdir()) == ["actor.0.json", "actor.1.json",
                                                                           "critic.0.json"]
        for manifest in (folder / "manifest").iterdir():
            listed = json.loads(manifest.read_text())["files"]
            assert listed and all((folder / name).stat().st_size == size for name, size in listed.items())
        assert not (folder / ".shared_folder_check").exists()
    got = metrics(out)
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got[4]["actor/grad_norm"] > 0 and got[4]["critic/vf_loss"] > 0  # the policy and the critic move
    assert got == metrics(once / "outputs" / "smoke"), "the resumed run continues exactly"
    for node in ("head", "node"):  # the workers' own folders got nothing
        assert sorted(p.name for p in (root / node).iterdir()) == []


def test_the_cluster_check_passes_on_the_ray_start_cluster(cluster, tiny_model_dir):
    folder = launch_folder(cluster["root"], "check", tiny_model_dir)
    result = ppo_train(folder, *run_args(cluster["address"]), "trainer.dry_run=true")
    assert result.returncode == 0, result.stderr[-3000:]
    check = result.stdout[result.stdout.index("# cluster check"):].splitlines()
    assert sum(line.startswith("node 127.0.0.1 [") for line in check) == 2
    assert f"model:    model.path={folder / 'models' / 'tiny'} resolves on every node" in check
    assert f"folder:   {folder / 'outputs' / 'smoke'}: every node sees the driver's marker in it and can write there" \
        in check
    assert [line.split(":")[0] for line in check if "all_reduce over" in line] == ["actor pool", "critic pool",
                                                                                    "rollout pool"]
    assert check[-1] == "cluster check passed: a run of this config can start here"
    assert sorted(p.name for p in folder.iterdir()) == ["digit_share.py", "models"]


def test_the_cluster_check_names_a_node_with_another_torch(cluster, tiny_model_dir):
    folder = launch_folder(cluster["root"], "check-torch", tiny_model_dir)
    node = cluster["node_b"]
    result = ppo_train(folder, *run_args(cluster["address"]), "trainer.dry_run=true", code=OTHER_TORCH,
                       extra=(cluster["address"], node))
    assert result.returncode == 2, result.stderr[-3000:]
    mismatch = f"node 127.0.0.1 [{node[:8]}]"
    assert any(line.startswith(f"FAILED: {mismatch}") and "has torch 2.12.1+cpu, the driver 2.13.0" in line
               for line in result.stdout.splitlines()), result.stdout[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("ppo-train")]
    assert len(errors) == 1 and errors[0].startswith("ppo-train: input error: the cluster check found 1 problem: ")
