"""What a run prints on the terminal: each step's line under a progress bar, the summary at the
end, paths as the user typed them; and where the engines' own output goes (engine.log), so that the
terminal shows only ours."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

# The compact per-step console line: (metric, label, format).
CONSOLE_COLUMNS = [
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/accuracy", "val_acc", "{:.3f}"),
    ("actor/reward_kl_penalty", "kl", "{:.4f}"),
    ("critic/vf_loss", "vf_loss", "{:.4f}"),
    ("critic/vf_explained_var", "ev", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("timing_s/step", "step_s", "{:.1f}"),
]


_console: Optional[TextIO] = None  # the terminal while engine_output_to_file is active


def console_stream() -> TextIO:
    """The terminal, also while descriptors 1 and 2 go into engine.log."""
    return _console or sys.stdout


# The engines' log levels (quiet, verbose), read when they are imported; a level the user set wins.
ENGINE_LOG_LEVELS = {"TRANSFORMERS_VERBOSITY": ("error", "info"), "VLLM_LOGGING_LEVEL": ("WARNING", "INFO")}
_user_set_levels: Optional[set[str]] = None


def set_engine_log_levels(verbose: bool) -> None:
    global _user_set_levels
    if _user_set_levels is None:  # the first call sees the user's environment; later ones see ours
        _user_set_levels = {var for var in ENGINE_LOG_LEVELS if var in os.environ}
    os.environ.update({var: levels[verbose] for var, levels in ENGINE_LOG_LEVELS.items()
                       if var not in _user_set_levels})


@contextlib.contextmanager
def engine_output_to_file(log_path: Path, verbose: bool = False) -> Iterator[None]:
    """Set the engines' log levels (`set_engine_log_levels`) and append descriptors 1 and 2 (not sys.stdout: C++ warnings and child processes inherit them) to
    `log_path`; `console_stream` and the "ppo_trainer" logger stay on the terminal. An empty log is removed."""
    global _console
    set_engine_log_levels(verbose)
    if verbose:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal, terminal_err = (os.fdopen(os.dup(fd), "w", buffering=1) for fd in (1, 2))  # restored at the end
    handler = logging.StreamHandler(terminal_err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    logging.getLogger("ppo_trainer").addHandler(handler)
    _console = terminal
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _console = None
        logging.getLogger("ppo_trainer").removeHandler(handler)
        for fd, stream in zip((1, 2), (terminal, terminal_err)):
            os.dup2(stream.fileno(), fd)
            stream.close()
        if log_path.is_file() and log_path.stat().st_size == 0:
            log_path.unlink()


class ConsoleProgress:
    """The console logger: a progress bar with a line per step (`CONSOLE_COLUMNS`) and, where
    validation reports several sources or samples, a second line (`validation_line`)."""

    def __init__(self, total_steps: int, start_step: int, columns: Sequence[tuple[str, str, str]] = CONSOLE_COLUMNS,
                 title: str = "PPO"):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.total_steps, self.columns = total_steps, columns
        # redirect_*=False: what the engines print goes to engine.log, not through the bar's console
        self.progress = Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=Console(file=console_stream()),
                                 redirect_stdout=False, redirect_stderr=False)
        self.task = self.progress.add_task("steps", total=total_steps, completed=start_step)
        self.progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        columns = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in self.columns
                   if metrics.get(key) is not None]
        self.progress.console.print("  ".join([f"step {step}/{self.total_steps}", *columns]), soft_wrap=True)
        if (line := validation_line(metrics)) is not None:
            self.progress.console.print(line, soft_wrap=True)
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        self.progress.stop()


def validation_line(metrics: dict[str, float]) -> Optional[str]:
    """The second console line of a step that validated several data_sources or sampled several
    responses per prompt: each val/<data_source>/accuracy and every .../accuracy/pass@n; None else."""
    shown = [key for key in metrics if key != "val/accuracy" and key.startswith("val/")
             and (key.endswith("/accuracy") or "/accuracy/pass@" in key)]
    per_source = [key for key in shown if key.endswith("/accuracy")]
    if len(per_source) < 2 and len(shown) == len(per_source):
        return None
    return "  " + "  ".join(f"{key} {metrics[key]:.3f}" for key in shown)


def random_model_note(cfg: Any) -> Optional[str]:
    """The console's line at start for a randomly initialised actor (model.path=random:...) on prompts
    it cannot learn in a few steps (anything but the digits tasks): zeros are what such a run shows,
    whether the reward works or not, so a miswired reward on one's own data must not pass for a
    working one (+experiment=smoke); None for other runs."""
    if not str(cfg.model.path).startswith("random:") or (cfg.data.source == "digits" and not cfg.data.train_files):
        return None
    return (f"model {cfg.model.path} is randomly initialised: this run checks the plumbing (every phase, "
            "checkpoints, resume), not learning; a score and val/accuracy of 0 are expected, also from a miswired "
            "reward. A run that learns: +experiment=digits (docs/learning.md)")


StepValue = tuple[Optional[int], Optional[float]]  # (step, value) of the objective, or (None, None)


def run_summary(output_dir: Path, *, steps: tuple[int, int, int], seconds: float, objective_name: str,
                final: StepValue, best: StepValue, best_dir: Optional[Path], last_dir: Optional[Path],
                stopped_by: Optional[str] = None, eval_overrides: Sequence[str] = ()) -> str:
    """The block printed when a run ends or a signal stops it after saving.
    steps: (first step of this invocation, last step done, trainer.total_steps). Its ppo-eval command
    runs from any folder: the checkpoint's absolute path and `eval_overrides` (the run's code keys,
    `config.trust.code_overrides`, which ppo-eval takes only from its command line)."""
    first, done, total = steps
    if stopped_by is not None:
        head = f"run stopped by {stopped_by} after step {done} of {total}; rerun the same command to continue"
    elif done < total:
        head = f"run paused after step {done} of {total} (trainer.stop_after_steps); rerun the same command to continue"
    else:
        head = f"run finished: {done} of {total} steps"

    def value(step_value: StepValue) -> str:
        step, number = step_value
        return "n/a" if step is None else f"{number:.4g} (step {step})"

    plots = output_dir / "plots.png"
    lines = [
        head,
        f"  steps this run:   {first} -> {done} in {_duration(seconds)}",
        f"  objective:        {objective_name} final {value(final)}, best {value(best)}",
        f"  best checkpoint:  {shown_path(best_dir) if best_dir is not None else 'none (no validation improved it yet)'}",
        f"  last checkpoint:  {shown_path(last_dir) if last_dir is not None else 'none'}",
        f"  plots:            {shown_path(plots) if plots.is_file() else 'not written (needs matplotlib)'}",
    ]
    if best_dir is not None or last_dir is not None:
        which = "best" if best_dir is not None else "last"
        command = ["ppo-eval", f"model.path={os.path.abspath(best_dir or last_dir)}", *eval_overrides]
        lines.append(f"  evaluate {which}:    {shlex.join(command)}")
    return "\n".join(lines)


def finished_text(checkpoint: Path, step: int, total_steps: int, summary: Optional[Path], objective_name: str,
                  last: StepValue) -> str:
    """What a rerun of a finished run prints instead of loading it again: one line saying so and how
    to go on, then the run's saved summary, or (without one) the last objective value."""
    step_at, value = last
    head = (f"ppo-train: this run already finished: {shown_path(checkpoint)} is step {step} of trainer.total_steps="
            f"{total_steps}; raise trainer.total_steps to continue it, or start over with trainer.resume=never")
    if summary is not None:
        return f"{head}. Its summary ({shown_path(summary)}):\n{summary.read_text().rstrip()}"
    last_objective = "n/a" if step_at is None else f"{value:.4g} (step {step_at})"
    return f"{head}. Last {objective_name}: {last_objective}"


def shown_path(path: Path) -> str:
    """`path` relative to the working folder when it lies inside it (what the user typed), else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
