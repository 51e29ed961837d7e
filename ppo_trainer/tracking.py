"""Where metrics go: metrics.jsonl, samples.jsonl, the loggers of trainer.loggers (the console's
progress in console.py), and plots.png."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ppo_trainer.config.secrets import mask_secrets
from ppo_trainer.console import CONSOLE_COLUMNS, ConsoleProgress

_SOURCE_ACCURACY = re.compile(r"^val/(.+)/accuracy$")  # val/<data_source>/accuracy (the name may hold slashes)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the records of steps <= last_step (a resumed run rewrites the rest) and no cut-short line."""
    if path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(path) if r["step"] <= last_step))
        os.replace(tmp, path)


class Tracker:
    """Fans one step's metrics out to the configured sinks."""

    def __init__(self, output_dir: Path, loggers: list[str], total_steps: int, start_step: int,
                 config: dict[str, Any], run_name: str, columns: Sequence[tuple[str, str, str]] = CONSOLE_COLUMNS,
                 title: str = "PPO"):
        """`columns`: the console line's (metric, label, format), whose metrics plots.png draws; `title`
        the progress bar's (ppo-train-rm passes its own)."""
        self.output_dir = output_dir
        self.plotted = [key for key, _, _ in columns if key != "timing_s/step"]
        self.metrics_path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        truncate_jsonl(self.metrics_path, start_step)
        truncate_jsonl(self.samples_path, start_step)
        self._sinks: list[tuple[Callable[[int, dict[str, float]], None], Callable[[], None]]] = []  # (log, close)
        if "console" in loggers:
            progress = ConsoleProgress(total_steps, start_step, columns, title)
            self._sinks.append((progress.log, progress.close))
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
        for log, _ in self._sinks:
            log(step, metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

    def close(self) -> None:
        for _, close in self._sinks:
            close()
        records = read_jsonl(self.metrics_path)
        if records:  # plots.png: the headline metrics against step, validation accuracy per data_source too
            sources = source_accuracy_keys(records)
            panels = [(key, [(None, metric_series(records, key))]) for key in self.plotted]
            if len(sources) > 1 and "val/accuracy" in self.plotted:
                curves = [("all", metric_series(records, "val/accuracy")),
                          *((name, metric_series(records, key)) for name, key in sources.items())]
                panels[self.plotted.index("val/accuracy")] = ("val/accuracy", curves)
            plot(self.output_dir / "plots.png", panels, cols=3, size=(4, 3))


def source_accuracy_keys(records: list[dict[str, Any]]) -> dict[str, str]:
    """{data_source: its "val/<data_source>/accuracy" key} of the sources the records validated,
    in order of first appearance."""
    found = (_SOURCE_ACCURACY.match(key) for record in records for key in record)
    return {match.group(1): match.group(0) for match in found if match}


def wandb_run_id(output_dir: Path) -> str:
    """The W&B run id of this output folder: made at its first start and saved in it, so a resume logs
    into the same run and another folder (another machine with the same path too) into its own."""
    path = output_dir / "wandb_run_id"
    if not path.is_file():
        tmp = path.with_name(".wandb_run_id.tmp")
        tmp.write_text(uuid.uuid4().hex[:16] + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()


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


def plot(out: Path, panels: list[tuple[str, list[tuple[Optional[str], list[tuple[float, float]]]]]], cols: int,
         size: tuple[float, float], xlabels: Optional[list[str]] = None, shared_legend: bool = False) -> None:
    """Curves: panels of (title, [(label or None, points)]), each `size` inches, against step (or
    each panel's `xlabels` entry). `shared_legend`: the panels show the same curves, named once
    below them (long labels, such as a sweep's overrides, would cover a panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for i, (ax, (title, curves)) in enumerate(zip(axes.flat, panels)):
        for label, points in curves:
            # an empty curve still takes its colour, so that each curve has one colour in every panel
            ax.plot(*(zip(*points) if points else ([], [])), marker="." if len(points) < 50 else None,
                    label=label if points else None)
        xlabel = xlabels[i] if xlabels else "step"
        if xlabel == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=title, xlabel=xlabel)
        ax.grid(alpha=0.3)
        if not shared_legend and any(line.get_label() and not line.get_label().startswith("_") for line in ax.lines):
            ax.legend(fontsize="small")
    fig.tight_layout()
    if shared_legend:
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(0, 0),
                   fontsize="small")
    fig.savefig(out, dpi=100, bbox_inches="tight")
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

