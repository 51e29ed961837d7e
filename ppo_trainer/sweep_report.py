"""`ppo-sweep-report SWEEP_DIR`: one row per job folder of a sweep, sorted by the final
`trainer.objective` (best first, as the jobs' `trainer.objective_direction` says), showing what
differs between runs. Train time sums `timing_s/step` (rollouts and updates, without loading and
validation)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from ppo_trainer.tracking import as_number, flatten, metric_series, plot, read_jsonl, source_accuracy_keys

ACCURACY = "val/accuracy"
# Final values shown for every run: (metric, column header, format).
FINAL_METRICS = [
    ("critic/score/mean", "score", "{:.3f}"),
    ("actor/reward_kl_penalty", "kl", "{:.4g}"),
    ("critic/vf_explained_var", "explained var", "{:.3f}"),
]
_NOT_SWEPT = {"trainer.output_dir"}  # differs between jobs by construction
_RUN_FILES = ("config.yaml", "metrics.jsonl", "overrides.yaml", ".hydra/overrides.yaml")


class UnrankableSweep(Exception):
    """The jobs of a sweep folder cannot be put in one order (exit 2, like a folder without runs)."""


@dataclass
class Run:
    """One job folder of a sweep."""

    name: str
    config: dict[str, Any]  # config.yaml, flattened to dotted keys
    metrics: list[dict[str, Any]]  # metrics.jsonl records, in step order
    overrides: Optional[list[str]]  # the job's command-line overrides, when recorded
    swept: dict[str, str] = field(default_factory=dict)  # what this run sets that others do not

    def series(self, metric: str) -> list[tuple[int, float]]:
        return metric_series(self.metrics, metric)

    def final(self, metric: str) -> Optional[float]:
        points = self.series(metric)
        return points[-1][1] if points else None

    def best(self, metric: str, maximize: bool) -> Optional[float]:
        values = [v for _, v in self.series(metric) if not math.isnan(v)]
        return (max(values) if maximize else min(values)) if values else None

    def against_seconds(self, metric: str) -> list[tuple[float, float]]:
        """(training seconds up to and including the step: the steps' timing_s/step summed, value) of
        each record that logged `metric`: the curve against the time it cost."""
        elapsed, at = 0.0, {}
        for record in self.metrics:
            elapsed += as_number(record.get("timing_s/step")) or 0.0
            at[int(record["step"])] = elapsed
        return [(at[step], value) for step, value in self.series(metric)]

    def train_seconds(self) -> Optional[float]:
        points = self.series("timing_s/step")
        return sum(v for _, v in points) if points else None

    def steps(self) -> str:
        done = max((int(r["step"]) for r in self.metrics), default=0)
        total = self.config.get("trainer.total_steps")
        return f"{done}/{total}" if total is not None else str(done)


def _short(text: Optional[str]) -> str:
    """A swept value for the table: long numbers (Optuna's samples) to 4 significant digits."""
    if text is None:
        return "-"
    try:
        return text if len(text) <= 8 else f"{float(text):.4g}"
    except ValueError:
        return text


def _read_yaml(path: Path) -> Any:
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None


def read_overrides(folder: Path) -> Optional[list[str]]:
    found = (_read_yaml(folder / name) for name in ("overrides.yaml", ".hydra/overrides.yaml"))
    return next(([str(o) for o in overrides] for overrides in found if isinstance(overrides, list)), None)


def find_runs(sweep_dir: Path) -> list[Run]:
    """The job folders of a sweep (those holding any of a run's files), by job number."""
    folders = [p for p in sweep_dir.iterdir() if p.is_dir() and any((p / name).is_file() for name in _RUN_FILES)]
    folders.sort(key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    return [Run(p.name, flatten(_read_yaml(p / "config.yaml")), read_jsonl(p / "metrics.jsonl"),
                read_overrides(p)) for p in folders]


def split_overrides(runs: list[Run]) -> list[str]:
    """Fill each run's `swept` (its overrides not shared by all, else its differing config values);
    return the overrides shared by all runs."""
    if all(run.overrides is not None for run in runs):
        shared = [o for o in runs[0].overrides if all(o in run.overrides for run in runs)] if len(runs) > 1 else []
        for run in runs:  # key=value -> swept[key] = value
            run.swept.update(o.partition("=")[::2] for o in run.overrides if o not in shared)
        return shared
    for key in sorted({k for run in runs for k in run.config} - _NOT_SWEPT):
        values = [run.config.get(key) for run in runs]
        if any(v != values[0] for v in values):
            for run, value in zip(runs, values):
                run.swept[key] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return []


@dataclass
class Report:
    sweep_dir: Path
    runs: list[Run]
    objective: str
    maximize: bool
    shared: list[str]
    command: Optional[str]
    optuna_best: Optional[dict[str, Any]]

    def swept_keys(self) -> list[str]:
        return list(dict.fromkeys(k for run in self.runs for k in run.swept))

    def objective_metrics(self) -> list[str]:
        return [ACCURACY] if self.objective == ACCURACY else [self.objective, ACCURACY]

    def source_metrics(self) -> list[str]:
        """The val/<data_source>/accuracy keys of the runs, when they validated more than one source."""
        keys = list(dict.fromkeys(k for run in self.runs for k in source_accuracy_keys(run.metrics).values()))
        return keys if len(keys) > 1 else []

    def columns(self) -> list[str]:
        objective_columns = [f"{m} {which}" for m in self.objective_metrics() for which in ("final", "best")]
        return ["job", *self.swept_keys(), *objective_columns, *(f"{m} final" for m in self.source_metrics()),
                *(h for _, h, _ in FINAL_METRICS), "steps", "train s"]

    def cells(self, run: Run) -> list[tuple[Any, str]]:
        """(raw value or None, table text) of each column for one run."""
        cells: list[tuple[Any, str]] = [(run.name, run.name)]
        cells += [(run.swept.get(key), _short(run.swept.get(key))) for key in self.swept_keys()]
        values: list[tuple[Optional[float], str]] = []
        for metric in self.objective_metrics():
            spec = "{:.3f}" if metric == ACCURACY else "{:.4g}"
            maximize = self.maximize if metric == self.objective else True  # higher accuracy is better
            values += [(run.final(metric), spec), (run.best(metric, maximize), spec)]
        values += [(run.final(metric), "{:.3f}") for metric in self.source_metrics()]
        values += [(run.final(metric), spec) for metric, _, spec in FINAL_METRICS]
        cells += [(v, "-" if v is None else spec.format(v)) for v, spec in values]
        seconds = run.train_seconds()
        return cells + [(run.steps(), run.steps()), (seconds, "-" if seconds is None else f"{seconds:.1f}")]

    def markdown(self) -> str:
        lines = [f"# Sweep report: {self.sweep_dir}", ""]
        if self.command:
            lines += [f"Command: `{self.command}`", ""]
        if self.shared:
            lines += ["Shared by all runs: `" + " ".join(self.shared) + "`", ""]
        order = "highest" if self.maximize else "lowest"
        lines += [f"{len(self.runs)} runs, sorted by final `{self.objective}` ({order} first).", ""]
        header = self.columns()
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for run in self.runs:
            lines.append("| " + " | ".join(text.replace("|", "\\|") for _, text in self.cells(run)) + " |")
        if self.optuna_best:
            lines += ["", f"Optuna best (optimization_results.yaml): `{self.optuna_best.get('best_params')}` -> "
                      f"{self.optuna_best.get('best_value')}"]
        return "\n".join(lines) + "\n"

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns())
            writer.writerows(["" if value is None else value for value, _ in self.cells(run)] for run in self.runs)


def build_report(sweep_dir: Path) -> Report:
    """Read a sweep folder; raises FileNotFoundError when it holds no runs, UnrankableSweep when
    its jobs disagree on trainer.objective_direction."""
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir} is not a folder")
    runs = find_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"no runs in {sweep_dir}: expected job folders (0, 1, ...) holding config.yaml, "
                                "metrics.jsonl or overrides.yaml; pass the folder of one sweep, e.g. "
                                "multirun/<experiment name>/<date_time>")
    multirun = _read_yaml(sweep_dir / "multirun.yaml") or {}
    hydra = multirun.get("hydra", {}) if isinstance(multirun, dict) else {}
    task = (hydra.get("overrides") or {}).get("task")
    objective = next((str(r.config["trainer.objective"]) for r in runs if "trainer.objective" in r.config), ACCURACY)
    optuna_best = _read_yaml(sweep_dir / "optimization_results.yaml")
    optuna_best = optuna_best if isinstance(optuna_best, dict) else None
    direction = job_direction(runs, sweep_dir)
    maximize = (direction == "maximize" if direction is not None
                else _maximize(hydra, optuna_best, [run.final(objective) for run in runs]))
    shared = split_overrides(runs)

    def sort_key(run: Run) -> tuple[bool, float]:
        value = run.final(objective)
        if value is None or math.isnan(value):
            return (True, 0.0)
        return (False, -value if maximize else value)

    runs.sort(key=sort_key)  # stable: ties keep job order
    command = "ppo-train --multirun " + " ".join(task) if task else None
    return Report(sweep_dir, runs, objective, maximize, shared, command, optuna_best)


def job_direction(runs: list[Run], sweep_dir: Path) -> Optional[str]:
    """The jobs' trainer.objective_direction (config.yaml), None when no job records it (a
    folder from before the key). Raises UnrankableSweep when jobs differ: no one order ranks them."""
    jobs: dict[str, list[str]] = {}
    for run in runs:
        if "trainer.objective_direction" in run.config:
            jobs.setdefault(str(run.config["trainer.objective_direction"]), []).append(run.name)
    if len(jobs) > 1:
        found = "; ".join(f"{direction} in job{'s' * (len(names) > 1)} {', '.join(names)}"
                          for direction, names in jobs.items())
        raise UnrankableSweep(f"trainer.objective_direction differs between the jobs of {sweep_dir} ({found}), so "
                              "no one order ranks them: move each direction's jobs into a folder of their own and "
                              "report each folder")
    return next(iter(jobs), None)


def _maximize(hydra: dict[str, Any], optuna_best: Optional[dict[str, Any]], finals: list[Optional[float]]) -> bool:
    """Whether a higher objective is better: the sweeper's `direction` in multirun.yaml (Hydra's
    basic sweeper writes it); the Optuna sweeper writes no multirun.yaml, but its best value is
    the lowest final objective of a search that minimised. Default: maximize. Only for job
    folders whose config.yaml predates trainer.objective_direction."""
    direction = (hydra.get("sweeper") or {}).get("direction")
    if direction is not None:
        return str(direction) != "minimize"
    values = [v for v in finals if v is not None and not math.isnan(v)]
    best = as_number((optuna_best or {}).get("best_value"))
    return not (best is not None and values and best == min(values) != max(values))


def plot_accuracy(report: Report, out: Path) -> None:
    """Overlay the val/accuracy curves of all runs, against step and against training seconds (what
    a run costs: a critic-free arm takes shorter steps)."""
    labels = [" ".join(f"{k}={_short(v)}" for k, v in run.swept.items()) for run in report.runs]
    names = [f"{run.name}: {label}" if label else run.name for run, label in zip(report.runs, labels)]
    by_step = [(name, run.series(ACCURACY)) for name, run in zip(names, report.runs)]
    by_time = [(name, run.against_seconds(ACCURACY)) for name, run in zip(names, report.runs)]
    title = f"{ACCURACY}: {report.sweep_dir.name}"
    plot(out, [(title, by_step), (title, by_time)], cols=2, size=(7, 4.5),
         xlabels=["step", "training seconds (timing_s/step summed)"], shared_legend=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="ppo-sweep-report",
        description="Compare the runs of a sweep: a table sorted by the objective (printed, report.md, "
                    "report.csv) and the validation-accuracy curves (val_accuracy.png), written into SWEEP_DIR.")
    parser.add_argument("sweep_dir", type=Path, metavar="SWEEP_DIR",
                        help="the folder of one sweep, e.g. multirun/smoke/2026-01-31_12-00-00")
    sweep_dir = parser.parse_args(argv).sweep_dir  # argv None: sys.argv[1:]
    try:
        report = build_report(sweep_dir)
    except (FileNotFoundError, UnrankableSweep) as e:
        print(f"ppo-sweep-report: {e}", file=sys.stderr)
        sys.exit(2)
    text = report.markdown()
    written = [sweep_dir / "report.md", sweep_dir / "report.csv", sweep_dir / "val_accuracy.png"]
    written[0].write_text(text)
    report.write_csv(written[1])
    print(text, end="")
    plot_accuracy(report, written[2])
    print(f"ppo-sweep-report: wrote {', '.join(str(path) for path in written)}")
