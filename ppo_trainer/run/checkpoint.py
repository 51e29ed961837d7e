"""Checkpoint layout (README "Outputs"), atomic commits, rotation in commit order, pointers and
resume resolution. Inside `<output_dir>/checkpoints/`:

| entry                         | what                                                            |
|-------------------------------|-----------------------------------------------------------------|
| global_step_N/                | actor/, critic/ (with LoRA: the adapters, and actor_merged/,    |
|                               | critic_merged/), state/ (actor/ and critic/: DCP shards;        |
|                               | trainer.json, rng.pt, config.yaml), and                         |
|                               | manifest/<role>.<rank>.json: what each worker rank wrote; no    |
|                               | critic parts when algorithm.adv_estimator is critic-free        |
| latest, best                  | one line each: the step folder they name                        |
| commit_order                  | step folders in the order they were committed, oldest first     |
| .incomplete_global_step_N/    | a step being written                                            |
| .replaced_global_step_N/      | the previous copy of a step being saved again                   |
| .removing_global_step_N/      | a rotated-out step being deleted                                |

A step is staged, checked against its manifests, fsynced and renamed into place before `latest`
moves: a crash at any moment leaves `latest` naming a complete checkpoint (`recover` tidies what
an interrupted save or rotation left). Rotation keeps the newest saves, not the highest step
numbers: a run resumed from an earlier step, or started over, never loses what it just saved.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config.composition import load_saved
from ppo_trainer.console import shown_path
from ppo_trainer.errors import InputError, RunError

log = logging.getLogger("ppo_trainer")

STEP_DIR = re.compile(r"^global_step_(\d+)$")
STAGING, REPLACED, REMOVING = ".incomplete_", ".replaced_", ".removing_"
COMMIT_ORDER = "commit_order"
MANIFESTS = "manifest"
DRIVER_FILES = ("state/trainer.json", "state/rng.pt", "state/config.yaml")  # written by `save_trainer_state`
# what every committed trainer.json holds (a resume reads them; reward_fingerprint and critic_warmup are
# newer, so a checkpoint of an earlier release lacks them: optional)
REQUIRED_STATE = ("step", "loader", "kl_ctrl", "nonfinite_streak", "best", "dtypes", "train_data", "reward_norm")


class CheckpointError(InputError):
    """A resume target that cannot be used; the message names the folder."""


class CheckpointSaveError(RunError):
    """A step could not be committed (a part is missing); the message names the role and the path."""


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dir(output_dir: Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"global_step_{step}"


def staging_dir(output_dir: Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"{STAGING}global_step_{step}"


def recover(output_dir: Path) -> None:
    """Undo what an interrupted save or rotation left: a step moved aside to be replaced goes back
    where its replacement never arrived (else it is deleted); staged and half-removed folders of
    any step are deleted, so a rerun after a full disk has its room back."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return
    for aside in root.glob(f"{REPLACED}global_step_*"):
        final = root / aside.name[len(REPLACED) :]
        if final.exists():
            shutil.rmtree(aside)
        else:
            os.replace(aside, final)
            _fsync(root)
    for leftover in [*root.glob(f"{STAGING}global_step_*"), *root.glob(f"{REMOVING}global_step_*")]:
        shutil.rmtree(leftover)


def begin(output_dir: Path, step: int) -> Path:
    """A fresh staging folder for step `step`, after `recover`."""
    recover(output_dir)
    staging = staging_dir(output_dir, step)
    staging.mkdir(parents=True)
    return staging


def write_manifest(checkpoint: Path, role: str, rank: int, folders: list[str]) -> Path:
    """manifest/<role>.<rank>.json: every file this rank of `role` sees under those of `folders` that
    exist (relative to the staged `checkpoint`), with its size, written after the role's collective
    save returned."""
    files = {str(path.relative_to(checkpoint)): path.stat().st_size for name in folders if (checkpoint / name).is_dir()
             for path in sorted((checkpoint / name).rglob("*")) if path.is_file()}
    manifest = checkpoint / MANIFESTS / f"{role}.{rank}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"role": role, "rank": rank, "host": socket.gethostname(), "files": files},
                                   indent=1) + "\n")
    return manifest


def verify(staging: Path, parts: Mapping[str, int]) -> None:
    """CheckpointSaveError unless every rank of every role in `parts` (role -> ranks) left its manifest
    in `staging`, every file a manifest lists is there at its size, and the driver's files exist."""
    shared = ("trainer.output_dir must be one folder that the driver and every worker see (a shared "
              "filesystem on a cluster)")
    for role, ranks in parts.items():
        for rank in range(ranks):
            manifest = staging / MANIFESTS / f"{role}.{rank}.json"
            if not manifest.is_file():
                raise CheckpointSaveError(f"the {role} worker (rank {rank}) was to write its part of the checkpoint "
                                          f"into {staging}, but {manifest} is missing here; {shared}")
            for name, size in json.loads(manifest.read_text())["files"].items():
                path = staging / name
                found = path.stat().st_size if path.is_file() else None
                if found != size:
                    what = "is missing" if found is None else f"has {found} bytes, not {size}"
                    raise CheckpointSaveError(f"the {role} worker (rank {rank}) wrote {path}, which {what} here; "
                                              f"{shared}")
    for name in DRIVER_FILES:
        if not (staging / name).is_file():
            raise CheckpointSaveError(f"the driver's {staging / name} is missing")


def commit(output_dir: Path, step: int, keep_last: int, parts: Mapping[str, int], best: bool = False) -> Path:
    """Check the staged step (`verify`), fsync it, rename it into place (an earlier copy of the step
    moved aside first, so no pointer ever names a half-deleted folder), point `latest` (and `best`)
    at it, record the commit and rotate."""
    staging = staging_dir(output_dir, step)
    verify(staging, parts)
    for folder, _, files in os.walk(staging):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))
    root = checkpoints_dir(output_dir)
    final = step_dir(output_dir, step)
    aside = root / f"{REPLACED}{final.name}"
    if final.exists():  # saving a step again, after resuming from an earlier one
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync(root)
    if best:
        write_pointer(output_dir, "best", step)
    write_pointer(output_dir, "latest", step)
    if aside.exists():
        shutil.rmtree(aside)
    rotate(output_dir, keep_last, committed=step)
    return final


def write_pointer(output_dir: Path, name: str, step: int) -> None:
    """checkpoints/<name> (`latest`, `best`) names global_step_<step>; replaced atomically."""
    _write_atomic(checkpoints_dir(output_dir) / name, step_dir(output_dir, step).name + "\n")


def complete_steps(output_dir: Path) -> list[int]:
    """Steps with a committed checkpoint folder, ascending."""
    return sorted(_step_number(p) for p in checkpoints_dir(output_dir).glob("global_step_*")
                  if p.is_dir() and STEP_DIR.match(p.name))


def commit_order(output_dir: Path) -> list[int]:
    """The committed steps, oldest save first: as `commit_order` recorded them, after any step
    folder it does not list (an older version's), those by step number."""
    recorded_file = checkpoints_dir(output_dir) / COMMIT_ORDER
    recorded = [_step_number(Path(name)) for name in recorded_file.read_text().split()
                if STEP_DIR.match(name)] if recorded_file.is_file() else []
    existing = set(complete_steps(output_dir))
    ordered = list(dict.fromkeys(step for step in recorded if step in existing))
    return sorted(existing - set(ordered)) + ordered


def rotate(output_dir: Path, keep_last: int, committed: int) -> None:
    """Record `committed` as the newest save, and remove every step but the `keep_last` newest saves,
    `committed` itself and the one `best` names (moved aside, then deleted: never half-deleted in place)."""
    order = [step for step in commit_order(output_dir) if step != committed] + [committed]
    keep = set(order[-keep_last:]) | {committed}
    best = pointed_step(output_dir, "best")
    if best is not None:
        keep.add(best)
    kept = [step for step in order if step in keep]
    _write_atomic(checkpoints_dir(output_dir) / COMMIT_ORDER, "".join(f"global_step_{s}\n" for s in kept))
    for step in order:
        if step not in keep:
            folder = step_dir(output_dir, step)
            doomed = folder.with_name(f"{REMOVING}{folder.name}")
            os.replace(folder, doomed)
            shutil.rmtree(doomed)


def read_pointer(pointer: Path) -> Optional[Path]:
    """The step folder a pointer file (checkpoints/latest, checkpoints/best) names; None if there is
    no pointer; CheckpointError if it names no checkpoint folder."""
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    folder = pointer.parent / name
    if not STEP_DIR.match(name) or not folder.is_dir():
        others = ", ".join(str(step_dir(pointer.parent.parent, s)) for s in reversed(commit_order(pointer.parent.parent)))
        where = f"resume from one that exists with trainer.resume=PATH ({others})" if others else "no checkpoint is left"
        raise CheckpointError(f"{pointer} names '{name}', which is not a checkpoint folder; {where}, "
                              "or start over with trainer.resume=never")
    return folder


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    return read_pointer(checkpoints_dir(output_dir) / "latest")


def pointed_step(output_dir: Path, name: str) -> Optional[int]:
    """The step that pointer `name` names, or None; a pointer whose folder is gone (a user freed
    disk) is removed with a warning (so the warning comes once) instead of failing every save."""
    try:
        folder = read_pointer(checkpoints_dir(output_dir) / name)
    except CheckpointError:
        pointer = checkpoints_dir(output_dir) / name
        log.warning("checkpoints/%s named %s, which is gone; removed the pointer (a later save writes it again)",
                    name, pointer.read_text().strip())
        pointer.unlink()
        return None
    return None if folder is None else _step_number(folder)


def last_complete(output_dir: Path) -> Optional[Path]:
    """The folder `latest` names if it is a complete checkpoint (for messages: never raises)."""
    try:
        return latest_checkpoint(output_dir)
    except CheckpointError:
        return None


def last_checkpoint_line(output_dir: Path) -> str:
    """Where a run that stops now stands, for its last message: its last complete checkpoint, or none."""
    last = last_complete(output_dir)
    return (f"the last complete checkpoint is {shown_path(last)}: rerun the same command to continue" if last
            else "no checkpoint was written yet: a rerun starts over")


def resolve_resume(output_dir: Path, resume: str) -> Optional[Path]:
    """trainer.resume: 'auto' (latest of output_dir, if any, after `recover`), 'never', or a
    checkpoint as ppo-eval's model.path names one: a global_step_N folder, a `latest` or `best`
    pointer file (the step it names now), or a run folder (its latest)."""
    if resume == "never":
        return None
    if resume == "auto":
        recover(output_dir)
        return latest_checkpoint(output_dir)
    folder = Path(os.path.abspath(Path(resume).expanduser()))
    if folder.is_file() and folder.parent.name == "checkpoints":
        folder = read_pointer(folder)
    elif checkpoints_dir(folder).is_dir() and not (folder / "state").is_dir():
        latest = latest_checkpoint(folder)
        if latest is None:
            raise CheckpointError(f"trainer.resume={resume}: the run holds no checkpoint yet; resume from "
                                  "another one, or start over with trainer.resume=never")
        folder = latest
    if not (folder / "state" / "trainer.json").is_file():
        raise CheckpointError(f"trainer.resume={resume}: not a complete checkpoint folder "
                              "(expected state/trainer.json inside checkpoints/global_step_N)")
    return folder


def save_trainer_state(folder: Path, state: dict[str, Any], rng: dict[str, torch.Tensor], config: DictConfig) -> None:
    """The driver's state: JSON for counters and positions, tensors for RNG states, and the resolved
    config the step was trained with (what a resume compares itself with)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer.json").write_text(json.dumps(state, indent=1) + "\n")
    torch.save(rng, folder / "rng.pt")
    OmegaConf.save(config, folder / "config.yaml")


def load_trainer_state(folder: Path, roles: Sequence[str] = ("actor", "critic"),
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The driver's state of a checkpoint, checked (with the state folders of `roles`, the trained
    roles of the run that loads it) before any model loads."""
    try:
        state = json.loads((folder / "trainer.json").read_text())
        rng = torch.load(folder / "rng.pt", weights_only=True)
        missing = [k for k in REQUIRED_STATE if k not in state]
        if missing:
            raise ValueError(f"trainer.json lacks {', '.join(missing)}")
        for role in roles:
            if not (folder / role).is_dir():
                raise ValueError(f"no {role} state folder")
    except (OSError, ValueError, RuntimeError, AttributeError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"corrupt resume state in {folder}: {str(e).splitlines()[0]}; resume from another "
                              "checkpoint with trainer.resume=PATH, or start over with trainer.resume=never") from None
    return state, rng


def saved_config(checkpoint: Path) -> DictConfig:
    """The resolved config a checkpoint folder (global_step_N) was trained with (`load_saved`: keys
    that have moved since at their new places)."""
    path = checkpoint / "state" / "config.yaml"
    try:
        config = load_saved(path)
    except Exception as e:  # noqa: BLE001  (OmegaConf raises yaml's and its own errors)
        raise CheckpointError(f"corrupt resume state in {path.parent}: config.yaml cannot be read "
                              f"({type(e).__name__}); resume from another checkpoint with trainer.resume=PATH, or "
                              "start over with trainer.resume=never") from None
    if not isinstance(config, DictConfig):
        raise CheckpointError(f"corrupt resume state in {path.parent}: config.yaml holds no mapping")
    return config


def _step_number(folder: Path) -> int:
    return int(STEP_DIR.match(folder.name).group(1))


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a hidden sibling, fsync it and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """Flush a file's, or a folder's (its entries: renames), contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_target(path: str) -> Optional[tuple[Path, Path, int]]:
    """(the actor folder to evaluate, the config file its run trained with, the step) when
    `path` names a checkpoint: a pointer file (checkpoints/latest, checkpoints/best), a run folder
    (its latest checkpoint), a `global_step_N` folder (its merged LoRA export, else its actor) or a
    folder inside one; None for anything else (a model). The config is the one the checkpoint was
    trained with (state/config.yaml). CheckpointError for a run folder without a checkpoint."""
    local = Path(path).expanduser()
    actor: Optional[Path] = None
    if local.is_file() and local.parent.name == "checkpoints":  # checkpoints/latest or checkpoints/best
        step_folder = read_pointer(local)
    elif local.is_dir() and (local / "checkpoints").is_dir() and not (local / "config.json").is_file():
        step_folder = latest_checkpoint(local)
        if step_folder is None:
            raise CheckpointError(f"model.path='{path}': the run holds no checkpoint yet")
    elif local.is_dir() and STEP_DIR.match(local.name):
        step_folder = local
    elif local.is_dir() and STEP_DIR.match(local.parent.name):
        step_folder, actor = local.parent, local
    else:
        return None
    run_config = step_folder / "state" / "config.yaml"
    if actor is None:
        merged = step_folder / "actor_merged"
        actor = merged if (merged / "config.json").is_file() else step_folder / "actor"
    return actor, run_config, int(STEP_DIR.match(step_folder.name).group(1))
