"""What a real cluster gets wrong, injected into the session's two simulated nodes (they share one
filesystem and one install, so a node's different view is made by a Ray `worker_process_setup_hook`
in the workers of node "b" only): an output folder that node does not see stops the start (exit 2)
or, seen at start but not under checkpoints/, the first save before anything is committed (exit 1, slow);
another torch there stops the start (exit 2); a rank left alone in a collective fails after
trainer.collective_timeout_s; the dry run's cluster check passes on the healthy cluster."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from ppo_trainer.cli import train_main
from ppo_trainer.config.composition import compose

from ..conftest import ray_overrides

ray = pytest.importorskip("ray")

# Actor ranks on one node, critic and rollout on the other: every check meets workers on node "b".
RUN = ["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false",
       "devices.devices_per_node=2", "devices.actor.num_devices=2", "trainer.loggers=[jsonl]"]


def node_b() -> str:
    """The Ray node id of the session cluster's second node (the one announcing NPUs)."""
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("NPU"))


def hide_markers(node_id: str, under: str) -> Callable[[], None]:
    """A setup hook: on `node_id`, a folder whose path contains `under` shows no marker, as a
    node-local folder of the same path would (and the worker does not wait for one to appear)."""
    def hook() -> None:  # nested: cloudpickle ships it by value to every worker of the job
        import ray

        from ppo_trainer.workers.cluster import nodes as cluster

        if ray.get_runtime_context().get_node_id() != node_id:
            return
        seen = cluster.read_marker
        cluster.read_marker = lambda folder: None if under in str(folder) else seen(folder)
        cluster.FOLDER_WAIT_S = 0.0

    return hook


def other_torch(node_id: str) -> Callable[[], None]:
    """A setup hook: the workers of `node_id` report torch 2.12.1."""
    def hook() -> None:
        import ray

        from ppo_trainer.workers.cluster import nodes as cluster

        if ray.get_runtime_context().get_node_id() != node_id:
            return
        found = cluster.package_versions
        cluster.package_versions = lambda packages=cluster.PACKAGES: {**found(packages), "torch": "2.12.1+cpu"}

    return hook


@contextmanager
def driver_with_hook(address: str, hook: Callable[[], None]) -> Iterator[None]:
    """This process joins the cluster with `hook` in its job's runtime environment (the run's
    `start_ray` keeps a connection it finds), and leaves it afterwards."""
    ray.shutdown()
    ray.init(address=address, runtime_env={"worker_process_setup_hook": hook})
    try:
        yield
    finally:
        ray.shutdown()


def run_cli(capsys, *args: str) -> tuple[int, list[str], str]:
    """ppo-train in this process: (exit code, its ppo-train lines on stderr, stdout)."""
    code = 0
    try:
        train_main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, [line for line in err.splitlines() if line.startswith("ppo-train")], out


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_node_that_does_not_see_the_output_folder_stops_the_start_with_one_line(ray_cluster, in_tmp, capsys):
    ray.init(address=ray_cluster, ignore_reinit_error=True)
    b, out = node_b(), in_tmp / "run"
    with driver_with_hook(ray_cluster, hide_markers(b, str(out))):
        code, lines, _ = run_cli(capsys, *RUN, f"devices.ray.address={ray_cluster}", f"trainer.output_dir={out}")
    assert code == 2 and len(lines) == 1
    assert re.fullmatch(
        rf"ppo-train: input error: node 127\.0\.0\.1 \[{b[:8]}\] \(host [^)]+\) does not see the folder "
        rf"{re.escape(str(out))} that the driver writes \(no "
        r"\.shared_folder_check appeared in it within 0 s\); trainer\.output_dir must be on a filesystem every node "
        r"mounts at the same path \(docs/cluster\.md\)", lines[0]), lines[0]
    assert not (out / "checkpoints").exists() and not (out / ".shared_folder_check").exists()


def test_a_node_with_another_torch_stops_the_start_naming_node_and_package(ray_cluster, in_tmp, capsys):
    ray.init(address=ray_cluster, ignore_reinit_error=True)
    b = node_b()
    with driver_with_hook(ray_cluster, other_torch(b)):
        code, lines, _ = run_cli(capsys, *RUN, f"devices.ray.address={ray_cluster}", f"trainer.output_dir={in_tmp}")
    assert code == 2 and len(lines) == 1
    assert re.fullmatch(rf"ppo-train: input error: node 127\.0\.0\.1 \[{b[:8]}\] \(host [^)]+\) has torch "
                        r"2\.12\.1\+cpu, the driver 2\.13\.0\S*: install the driver's versions of ppo_trainer, "
                        r"torch, transformers, vLLM and Ray on every node \(docs/cluster\.md\)", lines[0]), lines[0]


@pytest.mark.slow  # a whole step on Ray (about a minute); tests/workers/test_group.py has the worker's refusal
def test_a_checkpoint_folder_a_node_does_not_see_stops_the_first_save_before_the_commit(ray_cluster, in_tmp, capsys):
    """The output folder is shared, but checkpoints/ is not (e.g. a symlink to node-local disk): the
    start passes, the first save stops before any checkpoint is committed."""
    ray.init(address=ray_cluster, ignore_reinit_error=True)
    b, out = node_b(), in_tmp / "run"
    with driver_with_hook(ray_cluster, hide_markers(b, str(out / "checkpoints"))):
        code, lines, _ = run_cli(capsys, *RUN, f"devices.ray.address={ray_cluster}", f"trainer.output_dir={out}",
                                 "trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0")
    assert code == 1 and len(lines) == 1
    staged = re.escape(str(out / "checkpoints" / ".incomplete_global_step_1"))
    assert re.fullmatch(
        rf"ppo-train: stopped: (critic|actor) worker rank 0 of \d failed in save: SharedFolderError: node 127\.0\.0\.1 "
        rf"\[{b[:8]}\] \(host [^)]+\) does not see the folder {staged} that the driver writes \(no "
        r"\.shared_folder_check appeared in it within 0 s\); trainer\.output_dir must be on a filesystem every node "
        r"mounts at the same path \(docs/cluster\.md\)( \(1 other rank failed too\))?; no checkpoint was written yet: "
        r"a rerun starts over", lines[0]), lines[0]
    assert not (out / "checkpoints" / "latest").exists() and not (out / "checkpoints" / "global_step_1").exists()


def test_a_rank_left_alone_in_a_collective_fails_after_the_collective_timeout_naming_its_role(ray_cluster):
    from ppo_trainer.workers.accelerators import detect
    from ppo_trainer.workers.cluster.backend import PlacementPool, RayWorkers, fit_on_cluster, start_ray
    from ppo_trainer.workers.cluster.placement import plan_placement
    from ppo_trainer.workers.roles import WorkerError

    cfg = compose(ray_overrides(ray_cluster, actor=2, critic=1, rollout=1)
                  + ["devices.accelerator=cpu", "sampler.n=2", "trainer.collective_timeout_s=5"])
    kind = detect("cpu")
    start_ray(cfg, kind)
    placement = plan_placement(cfg)
    pool = PlacementPool(placement.pools[0], kind, fit_on_cluster(placement, kind, cfg.devices.ray.address))
    workers = RayWorkers(cfg, "actor", kind, placement.roles["actor"], pool)
    try:
        assert workers.join() == ["gloo on lo (127.0.0.1)"] * 2
        assert all(seconds < 5 for seconds in workers.on_hosts("a collective round trip", "round_trip"))
        with pytest.raises(WorkerError) as e:  # rank 1 never enters this all_reduce
            workers._gather([workers.hosts[0].round_trip.remote()], "a collective round trip")
    finally:
        workers.shutdown()
    message = str(e.value)
    assert message.startswith("actor worker rank 0 of 2 failed in a collective round trip: ")
    assert "Timed out waiting 5000ms" in message
    assert message.endswith("; the actor group's collectives wait at most trainer.collective_timeout_s=5 s for a peer "
                            "rank: one stopped or cannot reach this one (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: "
                            "docs/cluster.md)")


def test_the_dry_runs_cluster_check_passes_on_a_healthy_cluster(ray_cluster, in_tmp, capsys):
    code, lines, out = run_cli(capsys, *RUN, f"devices.ray.address={ray_cluster}", "trainer.dry_run=true")
    assert code == 0 and lines == [], lines
    check = out[out.index("# cluster check"):].splitlines()
    assert check[0] == f"# cluster check: Ray at {ray_cluster}"
    assert sum(line.startswith("node 127.0.0.1 [") for line in check) == 2
    assert all("answered and received a 1 MiB object" in line for line in check if line.startswith("node "))
    assert any(line.startswith("versions: ppo_trainer ") and line.endswith("on the driver and 2 nodes")
               for line in check)
    assert f"folder:   {in_tmp / 'outputs' / 'smoke'}: every node sees the driver's marker in it and can write there" \
        in check
    assert "model:    model.path=random:tiny resolves on every node" in check
    for pool, ranks in (("actor", 2), ("critic", 1), ("rollout", 1)):
        assert any(line.startswith(f"{pool} pool: {ranks} CPU slot") and line.endswith("as planned") for line in check)
        assert any(line.startswith(f"{pool} pool: all_reduce over {ranks} rank")
                   and line.endswith("(gloo on lo (127.0.0.1))") for line in check), pool
    assert check[-1] == "cluster check passed: a run of this config can start here"
    assert not (in_tmp / "outputs").exists(), "the check writes nothing it leaves behind"


def test_the_cluster_check_places_a_tensor_parallel_replica_as_one_worker_on_its_bundle(ray_cluster, in_tmp, capsys):
    """2 CPU slots, k=2: one replica, one bundle of 2 on one node, one rank in the pool's round trip."""
    code, lines, out = run_cli(capsys, *RUN, f"devices.ray.address={ray_cluster}", "trainer.dry_run=true",
                               "sampler=vllm", "devices.rollout.num_devices=2", "sampler.vllm.tensor_parallel_size=2")
    assert code == 0 and lines == [], lines
    check = out[out.index("# cluster check"):].splitlines()
    assert any(re.fullmatch(r"rollout pool: 2 CPU slots on Ray node \w{8}, as planned", line) for line in check), check
    assert any(line.startswith("rollout pool: all_reduce over 1 rank in ") for line in check)
    assert check[-1] == "cluster check passed: a run of this config can start here"
