"""What every node must share with the driver (`workers/cluster.py`), the interface gloo takes
(`workers/network.py`) and a launcher around ppo-train (`plan.launcher_problem`): pure pieces,
tested with fake node reports, folders and interface tables."""

from __future__ import annotations

import os
import re

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.plan.dry_run import launcher_problem
from ppo_trainer.workers.cluster.network import choose_gloo_interface, interface_with
from ppo_trainer.workers.cluster.nodes import (
    MARKER,
    ClusterMismatch,
    NodeReport,
    check_reports,
    folder_problem,
    model_paths,
    package_versions,
    packages_for,
    source_digest,
    version_problems,
    write_marker,
)

DRIVER = {"ppo_trainer": "0.1.0 (source 1a2b3c4d)", "torch": "2.13.0+cpu", "transformers": "5.19.0",
          "ray": "2.60.0"}


def report(node: str, problems: tuple[str, ...] = (), **versions: str | None) -> NodeReport:
    return NodeReport(f"node {node}", {**DRIVER, **versions}, problems)


def test_a_node_with_another_torch_release_stops_the_start_naming_node_package_and_both_versions():
    reports = [report("10.0.0.5 [aaaa1111] (host a)"), report("10.0.0.7 [bbbb2222] (host b)", torch="2.12.1+cu126")]
    with pytest.raises(ClusterMismatch) as e:
        check_reports(DRIVER, reports)
    assert str(e.value) == ("node 10.0.0.7 [bbbb2222] (host b) has torch 2.12.1+cu126, the driver 2.13.0+cpu: install "
                            "the driver's versions of ppo_trainer, torch, transformers, vLLM and Ray on every node "
                            "(docs/cluster.md)")


def test_every_difference_is_listed_once_per_node_whatever_its_number_of_workers():
    other_code = report("10.0.0.7 [bbbb2222] (host b)", ppo_trainer="0.1.0 (source 9f9f9f9f)", transformers=None)
    problems = version_problems(DRIVER, [other_code, other_code, report("10.0.0.5 [aaaa1111] (host a)")])
    assert problems == ["node 10.0.0.7 [bbbb2222] (host b) has ppo_trainer 0.1.0 (source 9f9f9f9f), the driver "
                        "0.1.0 (source 1a2b3c4d)",
                        "node 10.0.0.7 [bbbb2222] (host b) has transformers (not installed), the driver 5.19.0"]


def test_cpu_and_cuda_builds_of_one_torch_release_match():
    assert version_problems(DRIVER, [report("10.0.0.7 [bbbb2222] (host b)", torch="2.13.0+cu130")]) == []


def test_folder_and_model_problems_of_every_node_come_in_one_line_once_the_versions_agree():
    reports = [report("a", ("node a does not see the folder /o",)), report("a", ("node a does not see the folder /o",)),
               report("b", ("on node b: model.path='/m': folder not found",))]
    with pytest.raises(ClusterMismatch) as e:
        check_reports(DRIVER, reports)
    assert str(e.value) == "node a does not see the folder /o; on node b: model.path='/m': folder not found"
    check_reports(DRIVER, [report("a"), report("b")])  # nothing differs: no error


def test_vllm_is_compared_only_when_the_rollout_uses_it():
    assert packages_for(compose([])) == ("ppo_trainer", "torch", "transformers", "ray")
    assert packages_for(compose(["sampler=vllm"])) == ("ppo_trainer", "torch", "transformers", "vllm", "ray")


def test_this_processes_versions_name_the_source_it_imports():
    versions = package_versions(("ppo_trainer", "torch", "no_such_package_here"))
    assert re.fullmatch(r"\d+\.\d+\.\d+ \(source [0-9a-f]{8}\)", versions["ppo_trainer"])
    assert versions["ppo_trainer"].endswith(f"(source {source_digest()})")
    assert versions["torch"].startswith("2.") and versions["no_such_package_here"] is None


def test_a_worker_sees_the_drivers_folder_only_through_its_marker(tmp_path):
    token = write_marker(tmp_path / "out")
    assert folder_problem(tmp_path / "out", token, wait_s=0) is None
    assert not [p for p in (tmp_path / "out").iterdir() if p.name != MARKER], "the write check leaves nothing"
    elsewhere = tmp_path / "node-local"
    assert "(there is no such folder here)" in folder_problem(elsewhere, token, wait_s=0)
    elsewhere.mkdir()
    assert f"(no {MARKER} appeared in it within 0 s)" in folder_problem(elsewhere, token, wait_s=0)
    write_marker(elsewhere)  # an earlier run's marker in a folder of the same path on another node
    message = folder_problem(elsewhere, token, wait_s=0)
    assert message == (f"does not see the folder {elsewhere} that the driver writes (it holds another run's marker); "
                       "trainer.output_dir must be on a filesystem every node mounts at the same path "
                       "(docs/cluster.md)")


def test_a_folder_a_worker_cannot_write_is_named(tmp_path, monkeypatch):
    """Everything here runs as root, so a read-only mount is injected: the write check's file cannot be created."""
    from pathlib import Path

    token = write_marker(tmp_path)
    real = Path.write_text

    def read_only(self, *args, **kwargs):
        if self.name.startswith(".write_check"):
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    assert folder_problem(tmp_path, token, wait_s=0) == (f"cannot write into {tmp_path} (Permission denied); every "
                                                         "node's workers must be able to write there")


def test_workers_get_local_model_paths_made_absolute_against_the_drivers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "actor").mkdir(parents=True)
    cfg = compose(["model.path=models/actor", "critic.path=Qwen/Qwen2.5-0.5B"])
    assert model_paths(cfg) == {"model.path": str(tmp_path / "models" / "actor"), "critic.path": "Qwen/Qwen2.5-0.5B"}
    assert model_paths(compose(["model.path=random:tiny"])) == {"model.path": "random:tiny"}


def test_gloo_takes_the_interface_holding_the_address_that_reaches_the_rendezvous():
    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.7", "fe80::1"], "ib0": ["192.168.5.7"]}
    assert interface_with("10.0.0.7", interfaces) == "eth0"
    assert interface_with("192.168.5.7", interfaces) == "ib0"
    assert interface_with("127.0.1.1", interfaces) == "lo"  # what a Debian hostname resolves to
    assert interface_with("172.17.0.2", interfaces) is None


def test_a_loopback_rendezvous_sets_gloo_on_lo_unless_the_user_chose(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # restored (unset) after the test, whatever the test sets
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert choose_gloo_interface("127.0.0.1") == "gloo on lo (127.0.0.1)"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ens5")
    assert choose_gloo_interface("127.0.0.1") == "gloo on ens5 (GLOO_SOCKET_IFNAME)"


def test_a_launcher_starting_one_copy_per_rank_is_named_and_one_rank_is_fine():
    line = launcher_problem({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.5"})
    assert line.startswith("WORLD_SIZE=2 and RANK=1 are set: a launcher (torchrun, a Kubeflow PyTorchJob) started "
                           "this command once per rank")
    assert "unset WORLD_SIZE and RANK" in line
    assert launcher_problem({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launcher_problem({}) is None
