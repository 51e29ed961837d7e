"""Reward worker processes (`reward.num_workers`): calls run concurrently, each bounded by
`reward.timeout_s`; a worker that times out or dies is killed and replaced, and its rows fail.

Workers are fresh interpreters (fork + exec, not a fork of the driver): they hold none of the
driver's file descriptors (the output folder's lock among them), threads or CUDA state. Each runs
in its own session, so a Ctrl-C at the terminal reaches only the driver (which finishes its step);
on Linux the kernel SIGKILLs a worker when the driver thread that started it ends
(PR_SET_PDEATHSIG), so a SIGKILLed driver leaves no workers behind; start a pool from the thread
that uses it, for the run's life (the main thread). When a worker ends (closed, timed out, dead),
its process group is killed: what a reward function started (a sandbox, a subprocess) ends too.
Requests and replies are pickles framed by their length on two pipes per worker; a worker's
stdout and stderr are the driver's (engine.log during a run).

The driver side is `WorkerPool`; `serve` is a worker's loop.
"""

from __future__ import annotations

import json
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ppo_trainer.rewards.calling import (
    Failure,
    Outcome,
    RewardError,
    RewardInput,
    RewardSpec,
    call,
    import_reward,
    one_line,
)

START_TIMEOUT_S = 300.0  # a worker imports reward.fn's module (and what it imports: torch takes seconds)
_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1
# Run by each worker: the driver's sys.path first, so the worker imports the same modules the driver did.
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); from ppo_trainer.rewards.pool import serve; "
         "serve(*map(int, sys.argv[2:]))")


def _write(fd: int, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int) -> Any:
    """The next message on `fd`, or None at end of file (the other side is gone)."""
    header = _read_exact(fd, _HEADER.size)
    body = None if header is None else _read_exact(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


# --- a worker


def serve(request_fd: int, reply_fd: int, parent_pid: int) -> None:
    """A worker's life: die with the driver, load the function of the RewardSpec that comes first,
    answer "ready" (or "failed: reason"), then answer each task (rows) with `call`'s outcomes,
    until the driver closes the request pipe."""
    _die_with(parent_pid)
    spec: RewardSpec = _read(request_fd)
    try:
        fn = import_reward(spec.fn)
    except Exception as e:
        _write(reply_fd, ("failed", one_line(e)))
        return
    _write(reply_fd, ("ready", os.getpid()))
    while (rows := _read(request_fd)) is not None:
        _write(reply_fd, call(fn, spec.calling, rows))


def _die_with(parent_pid: int) -> None:
    """End this process when `parent_pid` ends: PR_SET_PDEATHSIG on Linux (immediate, even while a
    reward call hangs), elsewhere a thread that checks the parent every second."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


# --- the driver's side


class LoadError(RewardError):
    """A worker could not import the reward function; `reason` says why, in one line."""

    def __init__(self, fn: str, reason: str):
        super().__init__(f"a reward worker could not load reward.fn {fn}: {reason}")
        self.reason = reason


@dataclass
class _Worker:
    process: subprocess.Popen
    requests: int  # the driver's end of the request pipe
    replies: int  # the driver's end of the reply pipe
    state: str = "starting"  # starting | idle | busy
    task: int = -1  # the task a busy worker runs
    deadline: Optional[float] = None  # time.monotonic() past which it is killed (start or call)


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL a worker's process group, the worker (if it still runs) and whatever it started there
    (which would outlive it otherwise), and reap the worker. Also after the worker ended by itself:
    its group's id is not reused while a member lives, so the signal reaches only them."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the worker and everything it started are gone
        pass
    process.wait()


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        _kill(process)


class WorkerPool:
    """`size` worker processes calling `spec`'s function; `map` runs tasks (lists of rows) on them
    concurrently, each call bounded by `timeout_s` (None: unbounded). The constructor returns once
    every worker has loaded the function (LoadError if one's import fails, RewardError if one exits
    or takes START_TIMEOUT_S; the workers started are killed)."""

    def __init__(self, spec: RewardSpec, size: int, timeout_s: Optional[float]):
        if size < 1:
            raise ValueError(f"a reward worker pool needs at least one worker, got {size}")
        self.spec, self.timeout_s = spec, timeout_s
        self.selector = selectors.DefaultSelector()
        self.processes: list[subprocess.Popen] = []  # every worker started, for the finalizer
        self._finalizer = weakref.finalize(self, _kill_all, self.processes)
        self.workers: list[_Worker] = []
        try:
            for _ in range(size):
                self.workers.append(self._spawn())
            while any(w.state == "starting" for w in self.workers):
                self._wait(results=None, tasks=())
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> _Worker:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps([str(p) for p in sys.path]), str(request_read), str(reply_write), str(os.getpid())],
            pass_fds=(request_read, reply_write), stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(process)
        os.close(request_read)
        os.close(reply_write)
        worker = _Worker(process, request_write, reply_read, deadline=time.monotonic() + START_TIMEOUT_S)
        _write(request_write, self.spec)
        self.selector.register(reply_read, selectors.EVENT_READ, worker)
        return worker

    def _retire(self, worker: _Worker) -> _Worker:
        """Kill `worker` and start its replacement in its place."""
        self.selector.unregister(worker.replies)
        _kill(worker.process)
        os.close(worker.requests)
        os.close(worker.replies)
        self.processes.remove(worker.process)
        replacement = self._spawn()
        self.workers[self.workers.index(worker)] = replacement
        return replacement

    def map(self, tasks: Sequence[Sequence[RewardInput]]) -> list[list[Outcome]]:
        """Each task's outcomes (one per row), in task order. A call that outlives timeout_s, or whose
        worker dies, fails each of its rows (Failure, `timeout` set for the former); its worker is
        replaced."""
        results: list[Optional[list[Outcome]]] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while queue or any(w.state == "busy" for w in self.workers):
            for worker in [w for w in self.workers if w.state == "idle"]:
                if not queue:
                    break
                task = queue.popleft()
                try:
                    _write(worker.requests, list(tasks[task]))
                except BrokenPipeError:  # it died while idle: not the task's fault
                    queue.appendleft(task)
                    self._retire(worker)
                    continue
                worker.state, worker.task = "busy", task
                worker.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            self._wait(results, tasks)
        return results  # type: ignore[return-value]  # every task has its outcomes now

    def _wait(self, results: Optional[list[Optional[list[Outcome]]]], tasks: Sequence[Sequence[RewardInput]]) -> None:
        """Take the replies that arrive before the earliest deadline, then act on passed deadlines."""
        deadlines = [w.deadline for w in self.workers if w.deadline is not None and w.state != "idle"]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for key, _ in self.selector.select(timeout):
            worker: _Worker = key.data
            message = _read(worker.replies)
            if worker.state == "starting":
                if message is not None and message[0] == "failed":
                    raise LoadError(self.spec.fn, message[1])
                if message is None:
                    raise RewardError(f"a reward worker could not load reward.fn {self.spec.fn}: it exited "
                                      f"({_exit_status(worker.process)})")
                worker.state, worker.deadline = "idle", None
            elif message is None:
                status = _exit_status(worker.process)
                if worker.state == "busy":
                    results[worker.task] = [Failure(f"the reward worker died ({status}) during the call")] * len(
                        tasks[worker.task])
                self._retire(worker)
            else:
                results[worker.task] = message
                worker.state, worker.deadline = "idle", None
        now = time.monotonic()
        for worker in [w for w in self.workers if w.deadline is not None and w.deadline <= now]:
            if worker.state == "starting":
                raise RewardError(f"a reward worker did not load reward.fn {self.spec.fn} within {START_TIMEOUT_S:g} s")
            results[worker.task] = [Failure(f"did not return within reward.timeout_s={self.timeout_s:g} s",
                                            timeout=True)] * len(tasks[worker.task])
            self._retire(worker)

    def close(self) -> None:
        """End every worker: an idle one at the end of its request pipe, one still running after 2 s
        by SIGKILL; then each worker's process group is killed (`_kill`). Idempotent."""
        if not self._finalizer.alive:
            return
        for worker in self.workers:
            os.close(worker.requests)
        deadline = time.monotonic() + 2.0
        for worker in self.workers:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed with its group below
            self.selector.unregister(worker.replies)
            os.close(worker.replies)
        self.workers = []
        self.selector.close()
        self._finalizer()


def _exit_status(process: subprocess.Popen) -> str:
    """How a worker ended: "exit code N" or "killed by SIGKILL" (reaped; killed if it lingers 5 s)."""
    try:
        code = process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        _kill(process)
        code = process.returncode
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
