"""The optional metric sinks (tensorboard, wandb, mlflow), with stand-in modules: what each receives."""

from __future__ import annotations

import sys
import types

from ppo_trainer.tracking import Tracker


def test_each_listed_sink_gets_the_params_every_step_and_a_close(tmp_path, monkeypatch):
    calls = []
    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = lambda folder: types.SimpleNamespace(
        add_scalar=lambda key, value, step: calls.append(("tb", key, value, step)), close=lambda: calls.append("tb close"))
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls.append(("wandb init", kw["config"])) or types.SimpleNamespace(
        log=lambda metrics, step: calls.append(("wandb", metrics, step)), finish=lambda: calls.append("wandb finish"))
    mlflow = types.ModuleType("mlflow")
    mlflow.set_experiment = mlflow.start_run = lambda *a, **kw: None
    mlflow.log_params = lambda params: calls.append(("mlflow params", params))
    mlflow.log_metrics = lambda metrics, step: calls.append(("mlflow", metrics, step))
    mlflow.end_run = lambda: calls.append("mlflow end")
    for name, module in [("torch.utils.tensorboard", tensorboard), ("wandb", wandb), ("mlflow", mlflow)]:
        monkeypatch.setitem(sys.modules, name, module)

    config = {"model": {"path": "m", "hub_token": "secret"}}
    tracker = Tracker(tmp_path, ["jsonl", "tensorboard", "wandb", "mlflow"], 2, 0, config, "run")
    tracker.log(1, {"critic/score/mean": 0.5})
    tracker.close()
    assert calls == [
        ("wandb init", {"model": {"path": "m", "hub_token": "***"}}),
        ("mlflow params", {"model.path": "m", "model.hub_token": "***"}),
        ("tb", "critic/score/mean", 0.5, 1),
        ("wandb", {"critic/score/mean": 0.5}, 1),
        ("mlflow", {"critic.score.mean": 0.5}, 1),
        "tb close", "wandb finish", "mlflow end",
    ]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "critic/score/mean": 0.5}\n'


def test_a_shared_legend_sits_below_the_panels(tmp_path):
    from matplotlib.image import imread

    from ppo_trainer.tracking import plot

    long_label = "0: " + " ".join(f"algorithm.key_{i}=value" for i in range(8))
    panels = [("a", [(long_label, [(0, 0.1), (1, 0.2)])]), ("b", [(long_label, [(0.0, 0.1), (2.0, 0.2)])])]
    plot(tmp_path / "own.png", panels, cols=2, size=(4, 3))
    plot(tmp_path / "shared.png", panels, cols=2, size=(4, 3), shared_legend=True)
    own, shared = imread(tmp_path / "own.png"), imread(tmp_path / "shared.png")
    assert shared.shape[0] > own.shape[0], "the legend is added below the panels"
