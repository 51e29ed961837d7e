"""Deadlines for work that must not hang (`trainer.worker_timeout_s`): past one, a line on the
terminal, the stack of every thread on stderr (engine.log unless trainer.verbose), and the process
exits at once. A timer thread, so it fires while the main thread is stuck in a call."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
from typing import Callable, Iterator

log = logging.getLogger("ppo_trainer")


def expire(message: str, code: int, stacks: bool = True) -> None:
    """Say `message`, dump every thread's stack (with `stacks`) and end the process with `code`:
    os._exit, since the main thread may never return to run cleanup (the run lock goes with the process)."""
    log.error("ppo-train: %s", message)
    if stacks:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(code)


def start(seconds: float, message: Callable[[], str], code: int, stacks: bool = True) -> threading.Timer:
    """A daemon timer that calls `expire(message(), code, stacks)` after `seconds`; `cancel()` disarms it."""
    timer = threading.Timer(seconds, lambda: expire(message(), code, stacks))
    timer.daemon = True
    timer.start()
    return timer


@contextlib.contextmanager
def deadline(seconds: float, message: Callable[[], str], code: int = 1) -> Iterator[None]:
    """`start` for the duration of the block."""
    timer = start(seconds, message, code)
    try:
        yield
    finally:
        timer.cancel()
