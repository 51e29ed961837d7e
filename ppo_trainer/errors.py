"""The two kinds of error a run stops on, and their exit codes. `ppo-train` and `ppo-eval` print
either as one line (its message names the key, file, row, role or checkpoint), without a traceback.

- `InputError`: something the user gave is wrong (a config key, a file, a data row, a device
  request, a checkpoint to resume); found before anything trains: exit 2.
- `RunError`: the run failed while it trained (a reward that cannot score, a worker that died, a
  save that failed); its message names the last complete checkpoint (`checkpoint`, which the
  driver sets on every RunError that leaves a run): exit 1, or `exit_code`."""

from __future__ import annotations

from typing import Optional


class InputError(ValueError):
    """A problem with the user's input: exit 2."""

    exit_code = 2


class RunError(RuntimeError):
    """A failure during the run: exit 1 (a stop by a signal: 128 + its number)."""

    exit_code = 1
    checkpoint: Optional[str] = None  # where the run stands ("the last complete checkpoint is ..."), set by the driver

    def __str__(self) -> str:
        message = super().__str__()
        return message if self.checkpoint is None or self.checkpoint in message else f"{message}; {self.checkpoint}"
