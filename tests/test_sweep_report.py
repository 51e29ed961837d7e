"""`ppo-sweep-report` on hand-made sweep folders: columns, order, overrides, and its fallbacks."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

import pytest
from omegaconf import OmegaConf

from ppo_trainer.sweep_report import build_report, main


def make_run(sweep_dir: Path, job: str, lam: float, accuracy: list[float], overrides: Optional[list[str]],
             objective: str = "val/accuracy", total_steps: int = 2, extra: Optional[dict[str, Any]] = None,
             direction: Optional[str] = None) -> None:
    """A job folder: config.yaml (with trainer.objective_direction unless `direction` is None, as
    before the key existed), metrics.jsonl (step 0 validates, then one step per accuracy after the
    first), and overrides.yaml unless `overrides` is None."""
    run = sweep_dir / job
    run.mkdir(parents=True)
    config = {"gae": {"lam": lam, "gamma": 1.0},
              "trainer": {"output_dir": str(run), "total_steps": total_steps, "objective": objective}}
    if direction is not None:
        config["trainer"]["objective_direction"] = direction
    OmegaConf.save(OmegaConf.create(config), run / "config.yaml")
    if overrides is not None:
        OmegaConf.save(OmegaConf.create(overrides), run / "overrides.yaml")
    records = [{"step": 0, "val/accuracy": accuracy[0]}]
    for step, acc in enumerate(accuracy[1:], start=1):
        records.append({"step": step, "val/accuracy": acc, "critic/score/mean": 0.1 * step,
                        "actor/reward_kl_penalty": 0.001 * step, "critic/vf_explained_var": 0.5,
                        "timing_s/step": 1.5, **(extra or {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_runs_are_sorted_by_final_objective_with_final_and_best_values(tmp_path, capsys):
    shared = ["+experiment=smoke", "trainer.total_steps=2"]
    make_run(tmp_path, "0", 0.9, [0.1, 0.5, 0.2], [*shared, "gae.lam=0.9"])
    make_run(tmp_path, "1", 0.95, [0.1, 0.3, 0.4], [*shared, "gae.lam=0.95"])
    make_run(tmp_path, "2", 1.0, [0.1, 0.3, 0.3], [*shared, "gae.lam=1.0"])
    main([str(tmp_path)])
    rows = read_csv(tmp_path / "report.csv")
    assert [r["job"] for r in rows] == ["1", "2", "0"]  # final accuracy 0.4, 0.3, 0.2
    first = rows[0]
    assert first["gae.lam"] == "0.95"
    assert float(first["val/accuracy final"]) == 0.4 and float(first["val/accuracy best"]) == 0.4
    assert float(rows[2]["val/accuracy best"]) == 0.5  # job 0 peaked at step 1
    assert float(first["score"]) == pytest.approx(0.2) and float(first["kl"]) == pytest.approx(0.002)
    assert float(first["explained var"]) == 0.5 and first["steps"] == "2/2"
    assert float(first["train s"]) == pytest.approx(3.0)  # sum of timing_s/step
    markdown = (tmp_path / "report.md").read_text()
    assert "Shared by all runs: `+experiment=smoke trainer.total_steps=2`" in markdown
    assert "| 1 | 0.95 | 0.400 | 0.400 |" in markdown
    assert markdown in capsys.readouterr().out


def test_the_report_ends_saying_where_it_wrote_the_table_and_the_plot(tmp_path, capsys):
    make_run(tmp_path, "0", 0.9, [0.1, 0.5], ["gae.lam=0.9"])
    main([str(tmp_path)])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"ppo-sweep-report: wrote {tmp_path / 'report.md'}, {tmp_path / 'report.csv'}, " \
                   f"{tmp_path / 'val_accuracy.png'}"
    assert all((tmp_path / name).is_file() for name in ("report.md", "report.csv", "val_accuracy.png"))


def test_without_recorded_overrides_the_differing_config_values_are_shown(tmp_path):
    make_run(tmp_path, "0", 0.9, [0.0, 0.2], None)
    make_run(tmp_path, "1", 1.0, [0.0, 0.1], None)
    report = build_report(tmp_path)
    assert report.swept_keys() == ["gae.lam"]  # trainer.output_dir differs too, by construction
    assert [(r.name, r.swept["gae.lam"]) for r in report.runs] == [("0", "0.9"), ("1", "1.0")]


def test_hydra_overrides_file_is_used_when_present(tmp_path):
    make_run(tmp_path, "0", 0.9, [0.0, 0.2], None)
    (tmp_path / "0" / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(["gae.lam=0.9", "seed_note=a"]), tmp_path / "0" / ".hydra" / "overrides.yaml")
    report = build_report(tmp_path)
    assert report.runs[0].overrides == ["gae.lam=0.9", "seed_note=a"]


def test_a_custom_objective_to_minimize_sorts_lowest_first(tmp_path):
    make_run(tmp_path, "0", 0.9, [0.0, 0.2], ["gae.lam=0.9"], objective="critic/vf_loss", extra={"critic/vf_loss": 3.0})
    make_run(tmp_path, "1", 1.0, [0.0, 0.1], ["gae.lam=1.0"], objective="critic/vf_loss", extra={"critic/vf_loss": 1.0})
    OmegaConf.save(OmegaConf.create({"hydra": {"sweeper": {"direction": "minimize"}}}), tmp_path / "multirun.yaml")
    report = build_report(tmp_path)
    assert [r.name for r in report.runs] == ["1", "0"]
    assert report.columns()[2:4] == ["critic/vf_loss final", "critic/vf_loss best"]


def test_the_jobs_objective_direction_minimize_sorts_lowest_first_and_picks_the_lowest_as_best(tmp_path):
    """No sweeper direction recorded (a grid sweep): the jobs' own config.yaml says minimize."""
    for job, losses in (("0", [2.0, 3.0]), ("1", [0.5, 1.0])):
        make_run(tmp_path, job, 0.9 + 0.1 * int(job), [0.0, 0.5, 0.2], [f"gae.lam={0.9 + 0.1 * int(job)}"],
                 objective="critic/vf_loss", direction="minimize")
        records = [json.loads(line) for line in (tmp_path / job / "metrics.jsonl").read_text().splitlines()]
        for record, loss in zip(records[1:], losses):
            record["critic/vf_loss"] = loss
        (tmp_path / job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    main([str(tmp_path)])
    rows = read_csv(tmp_path / "report.csv")
    assert [r["job"] for r in rows] == ["1", "0"]  # final loss 1.0, 3.0
    assert [(r["critic/vf_loss final"], r["critic/vf_loss best"]) for r in rows] == [("1.0", "0.5"), ("3.0", "2.0")]
    assert [r["val/accuracy best"] for r in rows] == ["0.5", "0.5"]  # accuracy stays best when highest
    assert "sorted by final `critic/vf_loss` (lowest first)" in (tmp_path / "report.md").read_text()


def test_jobs_with_different_objective_directions_exit_2_naming_the_jobs(tmp_path, capsys):
    make_run(tmp_path, "0", 0.9, [0.0, 0.2], ["gae.lam=0.9"], direction="maximize")
    make_run(tmp_path, "1", 1.0, [0.0, 0.1], ["gae.lam=1.0"], direction="minimize")
    make_run(tmp_path, "2", 1.1, [0.0, 0.3], ["gae.lam=1.1"], direction="maximize")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"ppo-sweep-report: trainer.objective_direction differs between the jobs of {tmp_path} (maximize in jobs "
        "0, 2; minimize in job 1), so no one order ranks them: move each direction's jobs into a folder of their "
        "own and report each folder\n")
    assert not (tmp_path / "report.md").exists()


def test_runs_that_validated_several_sources_get_a_final_column_per_source(tmp_path):
    per_source = {"val/arith/accuracy": 0.5, "val/openai/gsm8k/accuracy": 0.125}
    make_run(tmp_path, "0", 0.9, [0.0, 0.3], ["gae.lam=0.9"], extra=per_source)
    make_run(tmp_path, "1", 1.0, [0.0, 0.2], ["gae.lam=1.0"], extra={**per_source, "val/arith/accuracy": 0.25})
    main([str(tmp_path)])
    rows = read_csv(tmp_path / "report.csv")
    assert [(r["val/arith/accuracy final"], r["val/openai/gsm8k/accuracy final"]) for r in rows] == [
        ("0.5", "0.125"), ("0.25", "0.125")]
    assert "| 0 | 0.9 | 0.300 | 0.300 | 0.500 | 0.125 |" in (tmp_path / "report.md").read_text()


def test_unfinished_and_failed_runs_sort_last_and_show_their_progress(tmp_path):
    make_run(tmp_path, "0", 0.9, [0.0], ["gae.lam=0.9"], total_steps=4)  # only the first validation
    with (tmp_path / "0" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "critic/sco')  # a line cut short by a killed job
    make_run(tmp_path, "1", 1.0, [0.0, 0.1], ["gae.lam=1.0"], total_steps=4)
    (tmp_path / "2").mkdir()  # failed before the trainer wrote anything
    OmegaConf.save(OmegaConf.create(["gae.lam=1.1"]), tmp_path / "2" / "overrides.yaml")
    report = build_report(tmp_path)
    assert [r.name for r in report.runs] == ["1", "0", "2"]
    assert [r.steps() for r in report.runs] == ["1/4", "0/4", "0"]
    assert "| 2 | 1.1 | - | - | - | - | - | 0 | - |" in report.markdown()


def test_a_folder_without_runs_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no runs in" in err


def test_an_optuna_search_that_minimised_is_sorted_lowest_first(tmp_path):
    make_run(tmp_path, "0", 0.9, [0.0, 0.2], ["gae.lam=0.9"])
    make_run(tmp_path, "1", 1.0, [0.0, 0.1], ["gae.lam=1.0"])
    best = {"name": "optuna", "best_params": {"gae.lam": 1.0}, "best_value": 0.1}
    OmegaConf.save(OmegaConf.create(best), tmp_path / "optimization_results.yaml")
    report = build_report(tmp_path)
    assert not report.maximize and [r.name for r in report.runs] == ["1", "0"]
    assert "Optuna best (optimization_results.yaml): `{'gae.lam': 1.0}` -> 0.1" in report.markdown()


def test_the_plot_shows_each_run_against_step_and_against_the_training_seconds_it_cost(tmp_path, monkeypatch):
    from ppo_trainer import sweep_report

    make_run(tmp_path, "0", 0.9, [0.1, 0.3, 0.5], ["gae.lam=0.9"])
    drawn = {}
    monkeypatch.setattr(sweep_report, "plot", lambda out, panels, cols, size, xlabels, shared_legend: drawn.update(
        panels=panels, xlabels=xlabels, shared_legend=shared_legend))
    sweep_report.plot_accuracy(build_report(tmp_path), tmp_path / "val_accuracy.png")
    (by_step, by_time) = [curves for _, curves in drawn["panels"]]
    assert by_step == [("0: gae.lam=0.9", [(0, 0.1), (1, 0.3), (2, 0.5)])]
    assert by_time == [("0: gae.lam=0.9", [(0.0, 0.1), (1.5, 0.3), (3.0, 0.5)])]  # 1.5 s a step
    assert drawn["xlabels"] == ["step", "training seconds (timing_s/step summed)"]
    assert drawn["shared_legend"], "one legend below both panels: a sweep's labels are long"
