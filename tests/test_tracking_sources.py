"""Per-data_source validation on the console and in plots.png."""

from __future__ import annotations

import ppo_trainer.tracking as tracking
from ppo_trainer.console import validation_line
from ppo_trainer.tracking import Tracker, source_accuracy_keys

TWO_SOURCES = {"critic/score/mean": 0.25, "val/accuracy": 0.5, "val/score/mean": 0.5,
               "val/arithmetic/accuracy": 0.75, "val/arithmetic/score/mean": 0.75,
               "val/openai/gsm8k/accuracy": 0.25, "val/openai/gsm8k/score/mean": 0.25}


def test_a_step_validating_two_sources_prints_each_sources_accuracy_on_a_second_line(tmp_path, capsys):
    tracker = Tracker(tmp_path, ["console"], 2, 0, {}, "run")
    tracker.log(1, TWO_SOURCES)
    tracker.close()
    printed = capsys.readouterr().out
    assert "step 1/2  score 0.250  val_acc 0.500\n" in printed
    assert "\n  val/arithmetic/accuracy 0.750  val/openai/gsm8k/accuracy 0.250\n" in printed


def test_pass_at_n_gets_a_line_also_for_one_source_and_one_greedy_source_none():
    sampled = {"val/accuracy": 0.5, "val/accuracy/mean@4": 0.5, "val/accuracy/pass@4": 0.75,
               "val/digits/accuracy": 0.5, "val/digits/accuracy/mean@4": 0.5, "val/digits/accuracy/pass@4": 0.75}
    assert validation_line(sampled) == \
        "  val/accuracy/pass@4 0.750  val/digits/accuracy 0.500  val/digits/accuracy/pass@4 0.750"
    assert validation_line({"val/accuracy": 0.5, "val/digits/accuracy": 0.5, "val/digits/score/mean": 0.5}) is None
    assert validation_line({"critic/score/mean": 0.1}) is None


def test_plots_draw_a_validation_curve_per_source_beside_the_pooled_one(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(tracking, "plot", lambda out, panels, cols, size: drawn.update(panels))
    tracker = Tracker(tmp_path, ["jsonl"], 2, 0, {}, "run")
    tracker.log(0, TWO_SOURCES)
    tracker.log(2, {**TWO_SOURCES, "val/accuracy": 0.6, "val/arithmetic/accuracy": 0.8})
    tracker.close()
    assert drawn["val/accuracy"] == [("all", [(0, 0.5), (2, 0.6)]), ("arithmetic", [(0, 0.75), (2, 0.8)]),
                                     ("openai/gsm8k", [(0, 0.25), (2, 0.25)])]
    assert source_accuracy_keys([TWO_SOURCES]) == {"arithmetic": "val/arithmetic/accuracy",
                                                   "openai/gsm8k": "val/openai/gsm8k/accuracy"}
