"""Calls into users' code (tools, an environment's constructor, reset and step) that may hang, run
concurrently and each bounded in time. Every call runs in a daemon thread of its own; what it
returns that must be awaited (an async method's coroutine) runs on one event loop, itself in a
daemon thread, shared by the calls of one rollout so that an environment's async state (a session,
a lock) stays on one loop from its reset to its last step. A call still running at its deadline is
abandoned: its pending coroutine is cancelled, its thread left to finish alone. Daemon threads
never hold up the process's exit, so a hung environment delays neither the step nor the exit.

An async method that blocks instead of awaiting (time.sleep inside `async def`) holds the shared
loop: every async call of the rollout then waits for it, and each is still ended at its deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ppo_trainer.rewards.calling import one_line

Resolve = Callable[[Any], Any]  # a value as it is, an awaitable as the value it resolves to
Job = Callable[[Resolve], Any]  # the work of one call; it passes what users' code returns through resolve


@dataclass(frozen=True)
class Result:
    """How one call ended: its value, or an error (one line), or a timeout (its error says so).
    A TimeoutError raised by the call itself (the python tool's own limit) counts as a timeout."""

    value: Any = None
    error: Optional[str] = None
    timeout: bool = False


class Call:
    """One running call: the thread's outcome once it finished, and the coroutine it awaits, if any,
    so that abandoning it can cancel that coroutine."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.pending: Optional[concurrent.futures.Future] = None
        self.abandoned = False
        self.lock = threading.Lock()  # between the thread starting a coroutine and the waiter abandoning the call

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
            pending = self.pending
        if pending is not None:
            pending.cancel()


class Runner:
    """Starts calls (`start`), waits for a batch of them under one deadline (`wait`), and lets go of
    whatever still runs (`close`)."""

    def __init__(self) -> None:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._lock = threading.Lock()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The shared loop, started on first use in a daemon thread."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="ppo-agents-loop", daemon=True).start()
            return self._loop

    def _resolver(self, call: Call) -> Resolve:
        """`resolve` for `call`'s thread: an awaitable runs on the shared loop and the thread blocks
        until it is done; `call.pending` holds it meanwhile, for cancelling."""
        def resolve(value: Any) -> Any:
            if not inspect.isawaitable(value):
                return value
            with call.lock:
                if call.abandoned:
                    raise asyncio.CancelledError()
                call.pending = asyncio.run_coroutine_threadsafe(_awaited(value), self._event_loop())
            try:
                return call.pending.result()
            finally:
                call.pending = None
        return resolve

    def start(self, job: Job) -> Call:
        """Run `job(resolve)` in a new daemon thread; returns at once."""
        call = Call()
        resolve = self._resolver(call)

        def run() -> None:
            try:
                call.value = job(resolve)
            except BaseException as e:  # the call's failure is its result, whatever it is (SystemExit too)
                call.error = e
            call.finished.set()

        threading.Thread(target=run, name="ppo-agents-call", daemon=True).start()
        return call

    def wait(self, calls: list[Call], timeout_s: float) -> list[Result]:
        """Each call's `Result`, waiting at most `timeout_s` from now for all of them together (they
        were started together); a call still running then is abandoned and reads as a timeout."""
        deadline = time.monotonic() + timeout_s
        results = []
        for call in calls:
            if not call.finished.wait(max(0.0, deadline - time.monotonic())):
                call.abandon()
                results.append(Result(error=f"timed out after {timeout_s:g}s", timeout=True))
            elif call.error is None:
                results.append(Result(value=call.value))
            elif isinstance(call.error, (TimeoutError, asyncio.TimeoutError)):
                results.append(Result(error=f"timed out ({one_line(call.error)})", timeout=True))
            else:
                results.append(Result(error=one_line(call.error)))
        return results

    def close(self) -> None:
        """Stop the shared loop once its current work yields; calls still running are left alone."""
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


async def _awaited(awaitable: Any) -> Any:
    """A coroutine of any awaitable (run_coroutine_threadsafe takes only coroutines)."""
    return await awaitable
