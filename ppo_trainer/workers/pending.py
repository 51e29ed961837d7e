"""`Pending`: a call submitted to workers that may still be running, so that the driver can start
the next phase before this one's result is needed (asynchronous rollouts, issue 51). Both backends
hand one out (`LocalWorkers.submit`, `RayWorkers.submit`); `WorkerGroup.submit_*` finishes it
(merging rows) and `run_*` is `submit_*(...).result()`."""

from __future__ import annotations

import functools
from typing import Callable, Generic, NoReturn, TypeVar

R = TypeVar("R")
T = TypeVar("T")


class Pending(Generic[R]):
    """`result()` waits for the call, within the deadline its backend set at submit, and returns what
    the blocking call returns or raises what it raises; a worker's error surfaces here, never at submit."""

    def __init__(self, wait: Callable[[], R]):
        self._wait = wait

    def result(self) -> R:
        return self._wait()

    def then(self, finish: Callable[[R], T]) -> "Pending[T]":
        """The same call, its result passed through `finish` (per-replica results -> rows in order)."""
        return Pending(lambda: finish(self.result()))


def ran(call: Callable[[], R]) -> Pending[R]:
    """`call` run to its end now, in this process, its value or its error kept for `result()`: the local
    backend has no second process to overlap with, and running at submit keeps the order of calls the
    order they were submitted in, as a Ray actor runs its calls."""
    try:
        value = call()
    except Exception as error:  # noqa: BLE001  (raised again, as it was, by result())
        return Pending(functools.partial(_raise, error))  # bound now: `error` is unbound after the block
    return Pending(lambda: value)


def _raise(error: Exception) -> NoReturn:
    raise error
