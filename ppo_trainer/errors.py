"""The two kinds of error a run stops on, and their exit codes. `ppo-train` and `ppo-eval` print
either as one line (its message names the key, file, row, role or checkpoint), without a traceback.

- `InputError`: something the user gave is wrong (a config key, a file, a data row, a device
  request, a checkpoint to resume); found before anything trains: exit 2.
- `RunError`: the run failed while it trained (a reward that cannot score, a worker that died, a
  save that failed): exit 1, or `exit_code`.
The driver adds the last complete checkpoint (`StopError.checkpoint`) to every RunError that leaves
a run, and to an InputError found after the models loaded (a reward's result at a validation)."""

from __future__ import annotations

import signal
from typing import Optional


class StopError(Exception):
    """What both kinds share: the message, and then where the run stands when the driver set it
    (`checkpoint`: "the last complete checkpoint is ...", unless the message says it already)."""

    checkpoint: Optional[str] = None

    def __str__(self) -> str:
        message = super().__str__()
        return message if self.checkpoint is None or self.checkpoint in message else f"{message}; {self.checkpoint}"


class InputError(StopError, ValueError):
    """A problem with the user's input: exit 2."""

    exit_code = 2


class RunError(StopError, RuntimeError):
    """A failure during the run: exit 1 (a stop by a signal: 128 + its number)."""

    exit_code = 1


class NonFiniteError(RunError):
    """Too many updates in a row had a non-finite loss or gradient norm."""


class StoppedBySignal(RunError):
    """A signal stopped the workers before the step could be saved; exit 128 + the signal's number."""

    def __init__(self, message: str, signum: signal.Signals):
        super().__init__(message)
        self.exit_code = 128 + int(signum)
