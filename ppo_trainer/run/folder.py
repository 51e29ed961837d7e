"""The output folder of a run (`trainer.output_dir`): one run at a time (a lock), an absolute path
for every process, the previous run moved aside by `trainer.resume=never`, config.yaml, the command
that ran it (command.txt) and its summary (summary.txt)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config.secrets import mask_secrets
from ppo_trainer.errors import InputError

log = logging.getLogger("ppo_trainer")

LOCK_FILE = ".run.lock"
COMMAND_FILE = "command.txt"  # each command that trained in the folder, one line each, the last one last
SUMMARY_FILE = "summary.txt"  # the last end-of-run summary, as printed
EVAL_DIR = "eval"  # ppo-eval's responses for a checkpoint of the run (global_step_N.jsonl) and its engine.log
# What a run writes into its folder; `trainer.resume=never` moves these aside (engine.log stays:
# every run appends to it).
RUN_FILES = ("checkpoints", "config.yaml", "metrics.jsonl", "samples.jsonl", "plots.png", "val_generations",
             "tensorboard", "wandb_run_id", "overrides.yaml", COMMAND_FILE, SUMMARY_FILE, EVAL_DIR)
# errno values of a filesystem without POSIX record locks (some network filesystems)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputDirBusy(InputError):
    """Another run holds the output folder; the message names it (pid, host, start time)."""


def absolute_output_dir(cfg: DictConfig) -> Path:
    """Make `trainer.output_dir` absolute, once, in the driver: Ray workers do not run in the
    driver's folder. Returns it."""
    cfg.trainer.output_dir = os.path.abspath(os.path.expanduser(cfg.trainer.output_dir))
    return Path(cfg.trainer.output_dir)


def output_dir_problem(output_dir: str) -> Optional[str]:
    """Why `trainer.output_dir` cannot be the run's folder (it, or a folder above it, is a file), or
    None: checked before Hydra or the run makes the folder, which would end in a traceback."""
    folder = Path(os.path.abspath(os.path.expanduser(output_dir)))
    for path in (folder, *folder.parents):
        if path.is_dir():
            return None
        if os.path.lexists(path):
            what = "a file, not a folder" if path.is_file() else "not a folder"
            return (f"trainer.output_dir={output_dir}: {path} is {what}; choose another trainer.output_dir, "
                    "or move the file away")
    return None


_held: dict[Path, int] = {}  # folder -> depth: the lock is re-entrant within this process


@contextlib.contextmanager
def exclusive(output_dir: Path) -> Iterator[None]:
    """Hold `output_dir` for this run: OutputDirBusy if another process holds it. A POSIX record lock
    (fcntl), which the kernel drops when the process dies, SIGKILL included, and which a child
    forked without exec (vLLM's engine, a reward worker pool) does not inherit, so it never
    outlives the driver. On a filesystem without locks: a warning and a pid+host file."""
    folder = Path(os.path.abspath(output_dir))
    if folder in _held:
        _held[folder] += 1
        try:
            yield
        finally:
            _held[folder] -= 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    release = _lock(path)
    _held[folder] = 1
    try:
        yield
    finally:
        del _held[folder]
        release()


def _holder_line() -> str:
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def _lock(path: Path) -> Any:
    """Take the lock file `path`; returns the function that releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)  # this process holds no lock on it: closing releases nothing
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise _busy(path) from None
        if e.errno not in _NO_LOCKS:
            raise
        log.warning("trainer.output_dir=%s: its filesystem has no file locks (%s); falling back to a pid file, "
                    "which a run killed with SIGKILL leaves behind", path.parent, os.strerror(e.errno))
        return _pid_file(path)
    os.ftruncate(fd, 0)
    os.write(fd, _holder_line().encode())

    def release() -> None:
        os.close(fd)  # drops the lock; the file stays (removing it would race with the next run's open)

    return release


def _pid_file(path: Path) -> Any:
    """The lock of a filesystem without locks: a file naming pid and host, refused while that pid
    lives (on this host) or belongs to another host."""
    if path.is_file() and path.read_text().strip():
        holder = path.read_text().split()
        pid, host = (int(holder[1]), holder[4].rstrip(",")) if len(holder) > 4 and holder[1].isdigit() else (0, "")
        if host != socket.gethostname() or _alive(pid):
            raise _busy(path, hint="if that run is gone, remove the file")
    path.write_text(_holder_line())
    return lambda: path.write_text("")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _busy(path: Path, hint: str = "wait for it to end or stop it") -> OutputDirBusy:
    holder = path.read_text().strip() if path.is_file() else "another process"
    return OutputDirBusy(f"trainer.output_dir={path.parent} is in use by another run ({holder or 'holder unknown'}; "
                         f"{path}); {hint}, or choose another trainer.output_dir")


def move_previous_run(output_dir: Path) -> Optional[Path]:
    """`trainer.resume=never` over a folder that holds a run: the previous run's files (`RUN_FILES`)
    go to previous-<time>/ inside it, and the new run starts with clean pointers. Returns that
    folder, or None when there was nothing to move."""
    if not any((output_dir / name).exists() for name in ("checkpoints", "config.yaml", "metrics.jsonl")):
        return None
    aside = output_dir / time.strftime("previous-%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    aside.mkdir()
    for name in RUN_FILES:
        if (output_dir / name).exists():
            os.replace(output_dir / name, aside / name)
    log.warning("trainer.resume=never: moved the previous run's checkpoints and metrics to %s", aside)
    return aside


def resolved_config(cfg: DictConfig) -> DictConfig:
    """The config as a run records it (config.yaml, each checkpoint): values of secret-looking keys
    and the credentials of URLs masked (`config.secrets.mask_secrets`)."""
    return OmegaConf.create(mask_secrets(OmegaConf.to_container(cfg)))


def write_config(output_dir: Path, cfg: DictConfig, command: Sequence[str] = ()) -> None:
    """<output_dir>/config.yaml, replaced atomically (a reader never sees half of it), and the
    command line that started this invocation (`command`, already masked) appended to command.txt."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / ".config.yaml.tmp"
    OmegaConf.save(resolved_config(cfg), tmp)
    os.replace(tmp, output_dir / "config.yaml")
    if command:
        with (output_dir / COMMAND_FILE).open("a") as f:
            f.write(shlex.join(command) + "\n")


def write_summary(output_dir: Path, summary: str) -> None:
    """<output_dir>/summary.txt: the end-of-run summary as printed (a rerun of a finished run prints it)."""
    (output_dir / SUMMARY_FILE).write_text(summary + "\n")
