"""Where metrics go (trainer.loggers, metrics.jsonl, samples.jsonl, plots.png), and engine.log."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TextIO
from urllib.parse import urlsplit, urlunsplit


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
PLOTTED = [key for key, _, _ in CONSOLE_COLUMNS if key != "timing_s/step"]
_SOURCE_ACCURACY = re.compile(r"^val/(.+)/accuracy$")  # val/<data_source>/accuracy (the name may hold slashes)
_SECRET = re.compile(r"(?i)(token|secret|password|api[_-]?key)")


def mask_secrets(value: Any, key: str = "") -> Any:
    """Replace values under keys that look like credentials with '***', and the credentials of any
    URL (`redact_url`), in dicts and lists, recursively: what a run writes or prints of its config."""
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v, key) for v in value]
    if isinstance(value, str) and value and _SECRET.search(key) and not key.endswith(("_tokens", "_length")):
        return "***"
    return redact_url(value) if isinstance(value, str) else value


def has_credentials(url: str) -> bool:
    """Whether `url` carries userinfo (`user:password@` or `token@` before its host)."""
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:  # not a URL urllib can split (e.g. "http://[::1"): nothing to mask in it
        return False


def redact_url(url: str) -> str:
    """`url` with the credentials of its userinfo shown as "***" (https://***@host/path): a URL may
    carry a password, and error messages and saved configs name the URL. Other text is returned as is."""
    if not has_credentials(url):
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the records of steps <= last_step (a resumed run rewrites the rest) and no cut-short line."""
    if path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(path) if r["step"] <= last_step))
        os.replace(tmp, path)


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


class Tracker:
    """Fans one step's metrics out to the configured sinks."""

    def __init__(self, output_dir: Path, loggers: list[str], total_steps: int, start_step: int,
                 config: dict[str, Any], run_name: str):
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.metrics_path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        truncate_jsonl(self.metrics_path, start_step)
        truncate_jsonl(self.samples_path, start_step)
        self._progress: Any = None
        if "console" in loggers:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            # redirect_*=False: what the engines print goes to engine.log, not through the bar's console
            self._progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      TextColumn("ETA"), TimeRemainingColumn(), console=Console(file=console_stream()),
                                      redirect_stdout=False, redirect_stderr=False)
            self._task = self._progress.add_task("steps", total=total_steps, completed=start_step)
            self._progress.start()
        self._sinks: list[tuple[Callable[[int, dict[str, float]], None], Callable[[], None]]] = []  # (log, close)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(output_dir / "tensorboard"))
            self._sinks.append((lambda step, m: [tb.add_scalar(k, v, step) for k, v in m.items()], tb.close))
        if "wandb" in loggers:
            import wandb

            run = wandb.init(project="ppo-trainer", name=run_name, config=mask_secrets(config),
                             dir=str(output_dir), resume="allow", id=wandb_run_id(output_dir))
            self._sinks.append((lambda step, m: run.log(m, step=step), run.finish))
        if "mlflow" in loggers:
            import mlflow

            mlflow.set_experiment("ppo-trainer")
            mlflow.start_run(run_name=run_name)
            mlflow.log_params({k: str(v) for k, v in flatten(mask_secrets(config)).items()})
            self._sinks.append((lambda step, m: mlflow.log_metrics({k.replace("/", "."): v for k, v in m.items()},
                                                                   step=step), mlflow.end_run))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._progress is not None:
            columns = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in CONSOLE_COLUMNS
                       if metrics.get(key) is not None]
            self._progress.console.print("  ".join([f"step {step}/{self.total_steps}", *columns]), soft_wrap=True)
            if (line := validation_line(metrics)) is not None:
                self._progress.console.print(line, soft_wrap=True)
            self._progress.update(self._task, completed=step)
        for log, _ in self._sinks:
            log(step, metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for _, close in self._sinks:
            close()
        records = read_jsonl(self.metrics_path)
        if records:  # plots.png: the headline metrics against step, validation accuracy per data_source too
            sources = source_accuracy_keys(records)
            panels = [(key, [(None, metric_series(records, key))]) for key in PLOTTED]
            if len(sources) > 1:
                curves = [("all", metric_series(records, "val/accuracy")),
                          *((name, metric_series(records, key)) for name, key in sources.items())]
                panels[PLOTTED.index("val/accuracy")] = ("val/accuracy", curves)
            plot(self.output_dir / "plots.png", panels, cols=3, size=(4, 3))


def source_accuracy_keys(records: list[dict[str, Any]]) -> dict[str, str]:
    """{data_source: its "val/<data_source>/accuracy" key} of the sources the records validated,
    in order of first appearance."""
    found = (_SOURCE_ACCURACY.match(key) for record in records for key in record)
    return {match.group(1): match.group(0) for match in found if match}


def validation_line(metrics: dict[str, float]) -> Optional[str]:
    """The second console line of a step that validated several data_sources or sampled several
    responses per prompt: each val/<data_source>/accuracy and every .../accuracy/pass@n; None else."""
    shown = [key for key in metrics if key != "val/accuracy" and key.startswith("val/")
             and (key.endswith("/accuracy") or "/accuracy/pass@" in key)]
    per_source = [key for key in shown if key.endswith("/accuracy")]
    if len(per_source) < 2 and len(shown) == len(per_source):
        return None
    return "  " + "  ".join(f"{key} {metrics[key]:.3f}" for key in shown)


def wandb_run_id(output_dir: Path) -> str:
    """The W&B run id of this output folder: made at its first start and saved in it, so a resume logs
    into the same run and another folder (another machine with the same path too) into its own."""
    path = output_dir / "wandb_run_id"
    if not path.is_file():
        tmp = path.with_name(".wandb_run_id.tmp")
        tmp.write_text(uuid.uuid4().hex[:16] + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()


StepValue = tuple[Optional[int], Optional[float]]  # (step, value) of the objective, or (None, None)


def run_summary(output_dir: Path, *, steps: tuple[int, int, int], seconds: float, objective_name: str,
                final: StepValue, best: StepValue, best_dir: Optional[Path], last_dir: Optional[Path],
                stopped_by: Optional[str] = None) -> str:
    """The block printed when a run ends or a signal stops it after saving.
    steps: (first step of this invocation, last step done, trainer.total_steps)."""
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
        lines.append(f"  evaluate {which}:    ppo-eval model.path={shown_path(best_dir or last_dir)}")
    return "\n".join(lines)


def shown_path(path: Path) -> str:
    """`path` relative to the working folder when it lies inside it (what the user typed), else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records in step order (stable), without a line cut short (still writing, or killed)."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return sorted(records, key=lambda r: r["step"])


def metric_series(records: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logged `metric` as a number (see `as_number`)."""
    points = [(int(r["step"]), as_number(r.get(metric))) for r in records]
    return [(step, value) for step, value in points if value is not None]


def as_number(value: Any) -> Optional[float]:
    """A metric value as a float: numbers, and the strings `_plain` writes for non-finite ones."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    non_finite = isinstance(value, str) and value.lower() in ("nan", "inf", "-inf")
    return float(value) if number or non_finite else None


def plot(out: Path, panels: list[tuple[str, list[tuple[Optional[str], list[tuple[int, float]]]]]], cols: int,
         size: tuple[float, float]) -> None:
    """Curves against step: panels of (title, [(label or None, points)]), each `size` inches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels):
        for label, points in curves:
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 50 else None, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if any(line.get_label() and not line.get_label().startswith("_") for line in ax.lines):
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: leaf}; an empty dict is a leaf, anything but a dict is {}."""
    out: dict[str, Any] = {}
    for key, value in d.items() if isinstance(d, dict) else []:
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out

