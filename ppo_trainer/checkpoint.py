"""Checkpoint layout (README "Outputs"), atomic commits, rotation and resume resolution.

global_step_N/state/ holds the exact-resume state: actor/ and critic/ (DCP: weights, optimizer,
scheduler), trainer.json (counters, positions), rng.pt. A step is written into a hidden staging
folder, fsynced and renamed into place before `latest` moves: a crash leaves the previous
checkpoint or the new one, never a half-written one.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(ValueError):
    """A resume target that cannot be used; the message names the folder."""


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dir(output_dir: Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"global_step_{step}"


def staging_dir(output_dir: Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f".incomplete_global_step_{step}"


def begin(output_dir: Path, step: int) -> Path:
    """A fresh staging folder for step `step` (a leftover from a crash is discarded)."""
    staging = staging_dir(output_dir, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(output_dir: Path, step: int, keep_last: int, best: bool = False) -> Path:
    """fsync the staged step, rename it into place, point `latest` (and `best`) at it, rotate."""
    staging = staging_dir(output_dir, step)
    for folder, _, files in os.walk(staging):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))
    final = step_dir(output_dir, step)
    if final.exists():  # re-saving a step after resuming from an earlier one
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync(final.parent)
    if best:
        write_pointer(output_dir, "best", step)
    write_pointer(output_dir, "latest", step)
    rotate(output_dir, keep_last)
    return final


def write_pointer(output_dir: Path, name: str, step: int) -> None:
    """checkpoints/<name> (`latest`, `best`) names global_step_<step>; replaced atomically."""
    pointer = checkpoints_dir(output_dir) / name
    tmp = pointer.with_name(f".{name}.tmp")
    tmp.write_text(step_dir(output_dir, step).name + "\n")
    _fsync(tmp)
    os.replace(tmp, pointer)
    _fsync(pointer.parent)


def complete_steps(output_dir: Path) -> list[int]:
    """Steps with a committed checkpoint folder, ascending."""
    return sorted(int(m.group(1)) for p in checkpoints_dir(output_dir).glob("global_step_*")
                  if p.is_dir() and (m := STEP_DIR.match(p.name)))


def rotate(output_dir: Path, keep_last: int) -> None:
    """Remove leftover staging folders and all steps but the newest `keep_last` and the `best` one."""
    best = read_pointer(checkpoints_dir(output_dir) / "best")
    for step in complete_steps(output_dir)[:-keep_last]:
        if best is None or step_dir(output_dir, step) != best:
            shutil.rmtree(step_dir(output_dir, step))
    for leftover in checkpoints_dir(output_dir).glob(".incomplete_global_step_*"):
        shutil.rmtree(leftover)


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    return read_pointer(checkpoints_dir(output_dir) / "latest")


def read_pointer(pointer: Path) -> Optional[Path]:
    """The step folder a pointer file (checkpoints/latest, checkpoints/best) names; None if none."""
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    folder = pointer.parent / name
    if not STEP_DIR.match(name) or not folder.is_dir():
        raise CheckpointError(f"{pointer} names '{name}', which is not a checkpoint folder; "
                              "remove the file to start over, or pass trainer.resume=PATH")
    return folder


def resolve_resume(output_dir: Path, resume: str) -> Optional[Path]:
    """trainer.resume: 'auto' (latest of output_dir, if any), 'never', or a checkpoint folder."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    folder = Path(resume)
    if not (folder / "state" / "trainer.json").is_file():
        raise CheckpointError(f"trainer.resume={resume}: not a complete checkpoint folder "
                              "(expected state/trainer.json inside checkpoints/global_step_N)")
    return folder


def save_trainer_state(folder: Path, state: dict[str, Any], rng: dict[str, torch.Tensor]) -> None:
    """The driver's state: JSON for counters and positions, tensors for RNG states."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer.json").write_text(json.dumps(state, indent=1) + "\n")
    torch.save(rng, folder / "rng.pt")


def load_trainer_state(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The driver's state of a checkpoint, checked (with both engines' folders) before any model loads."""
    try:
        state = json.loads((folder / "trainer.json").read_text())
        rng = torch.load(folder / "rng.pt", weights_only=True)
        missing = [k for k in ("step", "loader", "kl_ctrl") if k not in state]
        if missing:
            raise ValueError(f"trainer.json lacks {', '.join(missing)}")
        for role in ("actor", "critic"):
            if not (folder / role).is_dir():
                raise ValueError(f"no {role} state folder")
    except (OSError, ValueError, RuntimeError, AttributeError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"corrupt resume state in {folder}: {str(e).splitlines()[0]}; resume from another "
                              "checkpoint with trainer.resume=PATH, or start over with trainer.resume=never") from None
    return state, rng


def _fsync(path: Path) -> None:
    """Flush a file's, or a folder's (its entries: renames), contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
