"""The `ppo-train-rm` run: compose and check the config, read the pairs (before any model loads),
train `trainer.total_steps` optimizer steps of `data.train_batch_size` pairs, validate on the
held-out pairs, save atomic checkpoints (`run.checkpoint`) that resume exactly, and end with a
summary naming the best checkpoint and the `ppo-train` command that uses it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shlex
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config.paths import absolute_paths
from ppo_trainer.config.rm_schema import RM_CONFIG_NAME, validate_rm
from ppo_trainer.config.schema import CONFIG_DIR, ConfigError
from ppo_trainer.console import console_stream, engine_output_to_file, shown_path
from ppo_trainer.core.pairwise import pairwise_metrics, score_statistics
from ppo_trainer.data import PromptLoader
from ppo_trainer.run import checkpoint, resume
from ppo_trainer.run import folder as run_folder
from ppo_trainer.tracking import Tracker, metric_series, read_jsonl

log = logging.getLogger("ppo_trainer")

ROLE = "reward_model"  # checkpoints/global_step_N/reward_model/ (the HF folder) and state/reward_model/ (DCP)
# A change of these makes a checkpoint continue another run (`resume.check_config`): another model or
# LoRA shape, other training pairs or order, other batches.
REFUSED = ("model.path", "model.lora.rank", "model.lora.target_modules", "data.source", "data.hub_config",
           "data.train_split", "data.train_files", "data.prompt_key", "data.chosen_key", "data.rejected_key",
           "data.margin_key", "data.source_key", "data.shuffle", "data.train_batch_size", "data.max_length",
           "trainer.seed")
COLUMNS = [("train/loss", "loss", "{:.4f}"), ("train/pairwise_accuracy", "acc", "{:.3f}"),
           ("val/pairwise_accuracy", "val_acc", "{:.3f}"), ("val/margin/mean", "val_margin", "{:.3f}"),
           ("train/grad_norm", "grad_norm", "{:.3f}"), ("timing_s/step", "step_s", "{:.1f}")]
SCORES_PLOT = "scores.png"  # the held-out score distribution, chosen against rejected, at the last validation


def compose_rm(overrides: Sequence[str]) -> DictConfig:
    """configs/rm.yaml with `overrides`, typed and checked (`validate_rm`); ConfigError naming the key."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name=RM_CONFIG_NAME, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    return validate_rm(cfg)


def pairs_fingerprint(pairs: Sequence[Any]) -> dict[str, Any]:
    """{"records", "sha256"} of the training pairs (tokens, margin, source), in load order."""
    digest = hashlib.sha256()
    for p in pairs:
        digest.update(json.dumps([p.chosen_ids, p.rejected_ids, p.margin, p.data_source]).encode())
    return {"records": len(pairs), "sha256": digest.hexdigest()[:16]}


def validation_metrics(chosen: torch.Tensor, rejected: torch.Tensor, pairs: Sequence[Any]) -> dict[str, float]:
    """`pairwise_metrics` of the held-out scores [N], pooled and, with several data_sources, per source
    (val/<data_source>/pairwise_accuracy, /margin/mean)."""
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float64)
    metrics = pairwise_metrics(chosen, rejected, margin)
    sources = list(dict.fromkeys(p.data_source for p in pairs))
    for source in sources if len(sources) > 1 else []:
        rows = torch.tensor([i for i, p in enumerate(pairs) if p.data_source == source])
        part = pairwise_metrics(chosen[rows], rejected[rows], margin[rows])
        metrics[f"val/{source}/pairwise_accuracy"] = part["val/pairwise_accuracy"]
        metrics[f"val/{source}/margin/mean"] = part["val/margin/mean"]
    return metrics


def plot_scores(path: Path, chosen: torch.Tensor, rejected: torch.Tensor, step: int) -> None:
    """A histogram of the held-out scores [N], chosen against rejected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bins = torch.linspace(float(torch.cat([chosen, rejected]).min()), float(torch.cat([chosen, rejected]).max()) + 1e-6,
                          31).tolist()
    ax.hist(chosen.tolist(), bins=bins, alpha=0.6, label="chosen")
    ax.hist(rejected.tolist(), bins=bins, alpha=0.6, label="rejected")
    ax.set(title=f"held-out scores at step {step}", xlabel="score", ylabel="responses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_resume(cfg: DictConfig, output_dir: Path) -> Optional[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(checkpoint folder, trainer state, RNG state) to continue from, checked against the config
    (`resume.check_config` with `REFUSED`) before any model loads; None for a fresh start."""
    if cfg.trainer.resume == "never":
        run_folder.move_previous_run(output_dir)
    folder = checkpoint.resolve_resume(output_dir, cfg.trainer.resume)
    if folder is None:
        return None
    try:
        state = json.loads((folder / "state" / "trainer.json").read_text())
        rng = torch.load(folder / "state" / "rng.pt", weights_only=True)
        if not (folder / "state" / ROLE).is_dir() or not {"step", "loader", "best", "train_data"} <= set(state):
            raise ValueError("no reward model state")
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise checkpoint.CheckpointError(f"corrupt resume state in {folder}: {str(e).splitlines()[0]}; resume from "
                                         "another checkpoint with trainer.resume=PATH, or start over with "
                                         "trainer.resume=never") from None
    try:  # as saved: checkpoint.saved_config would add ppo-train's keys added since older runs
        saved = OmegaConf.load(folder / "state" / "config.yaml")
    except Exception as e:  # noqa: BLE001  (OmegaConf raises yaml's and its own errors)
        raise checkpoint.CheckpointError(f"corrupt resume state in {folder}: its config.yaml cannot be read "
                                         f"({type(e).__name__}); start over with trainer.resume=never") from None
    resume.check_config(folder, saved, state, run_folder.resolved_config(cfg), REFUSED)
    return folder, state, rng


def ppo_command(model_folder: Path) -> str:
    """The ppo-train command that trains a policy against the reward model in `model_folder` alone."""
    return shlex.join(["ppo-train", "reward.fn=null", f"reward.model.path={os.path.abspath(model_folder)}",
                       "reward.model.normalize=true"])


def summary(output_dir: Path, steps: tuple[int, int, int], seconds: float, objective: str) -> str:
    """The end block: steps, the held-out accuracy (final and best), the best checkpoint's model
    folder and the ppo-train command that uses it."""
    first, done, total = steps
    points = metric_series(read_jsonl(output_dir / "metrics.jsonl"), objective)
    best_step = checkpoint.pointed_step(output_dir, "best")
    last_step = checkpoint.pointed_step(output_dir, "latest")
    chosen = best_step if best_step is not None else last_step
    best_value = next((v for s, v in points if s == best_step), None)
    final = f"{points[-1][1]:.4f} (step {points[-1][0]})" if points else "n/a"
    lines = [f"ppo-train-rm: run {'finished' if done >= total else 'paused'} after step {done} of {total} "
             f"(steps {first} -> {done} in {seconds:.0f} s)",
             f"  {objective} (held-out): final {final}, best "
             + (f"{best_value:.4f} (step {best_step})" if best_value is not None else "n/a")]
    if chosen is not None:
        model = checkpoint.step_dir(output_dir, chosen) / ROLE
        lines += [f"  {'best' if best_step is not None else 'last'} reward model: {os.path.abspath(model)}",
                  f"  score distribution: {shown_path(output_dir / SCORES_PLOT)}; curves: "
                  f"{shown_path(output_dir / 'plots.png')}",
                  f"  use it: {ppo_command(model)}"]
    return "\n".join(lines)


def run_rm(cfg: DictConfig, command: Sequence[str] = ()) -> Optional[float]:
    """Train the reward model of `cfg` (from `compose_rm`); returns the last held-out accuracy."""
    output_dir = run_folder.absolute_output_dir(cfg)
    absolute_paths(cfg)  # config.yaml and the checkpoints name the data files wherever the run is read from
    with run_folder.exclusive(output_dir), engine_output_to_file(output_dir / "engine.log", cfg.trainer.verbose):
        return _run(cfg, output_dir, command)


def _run(cfg: DictConfig, output_dir: Path, command: Sequence[str]) -> Optional[float]:
    from ppo_trainer.models.loading import load_tokenizer, resolve_model_path
    from ppo_trainer.rm.pairs import load_pairs

    resumed = load_resume(cfg, output_dir)
    if resumed is not None and int(resumed[1]["step"]) >= cfg.trainer.total_steps:
        text = (output_dir / run_folder.SUMMARY_FILE).read_text().rstrip() if (
            output_dir / run_folder.SUMMARY_FILE).is_file() else ""
        print(f"ppo-train-rm: this run already finished at step {resumed[1]['step']}; raise trainer.total_steps to "
              f"continue it, or start over with trainer.resume=never\n{text}", file=console_stream())
        return None
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    train, val = load_pairs(cfg.data, tokenizer, "train"), load_pairs(cfg.data, tokenizer, "val")
    fingerprint = pairs_fingerprint(train)
    if resumed is not None and resumed[1]["train_data"] != fingerprint and "data" not in cfg.trainer.resume_allow:
        raise ConfigError(f"resume refused: the training pairs differ from those of step {resumed[1]['step']}, so the "
                          "saved data position means other pairs; use another trainer.output_dir, "
                          "trainer.resume=never, or accept it with trainer.resume_allow=[data]")
    run_folder.write_config(output_dir, cfg, command)

    from ppo_trainer.rm.engine import PairEngine
    from ppo_trainer.workers.accelerators import detect

    engine = PairEngine(cfg, model_dir, tokenizer.pad_token_id, detect(cfg.devices.accelerator).torch_device_type)
    loader = PromptLoader(train, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    step, best = 0, None
    if resumed is not None:
        folder, state, rng = resumed
        engine.load_state(folder / "state" / ROLE)
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(rng["torch"])
        step, best = int(state["step"]), state["best"]
        log.info("resumed from %s (step %d)", shown_path(folder), step)
    tracker = Tracker(output_dir, list(cfg.trainer.loggers), cfg.trainer.total_steps, step, {}, cfg.trainer.experiment_name,
                      COLUMNS, "RM")
    start, first = time.perf_counter(), step
    last: Optional[float] = None
    try:
        if step == 0:
            metrics = validate(engine, val, output_dir, step)
            last = metrics[cfg.trainer.objective]
            tracker.log(0, metrics)
        stop_at = min(cfg.trainer.total_steps, step + (cfg.trainer.stop_after_steps or cfg.trainer.total_steps))
        while step < stop_at:
            began = time.perf_counter()
            metrics = engine.update(next(loader))
            step += 1
            t = cfg.trainer
            if step == t.total_steps or (t.val_every and step % t.val_every == 0):
                metrics |= validate(engine, val, output_dir, step)
                last = metrics[t.objective]
            improved = t.objective in metrics and (best is None or metrics[t.objective] > best["value"])
            if improved:
                best = {"step": step, "value": metrics[t.objective]}
            if step == stop_at or (t.save_every and step % t.save_every == 0) or improved:
                save(engine, tokenizer, train, cfg, output_dir, step, loader, best, fingerprint, improved)
            metrics["timing_s/step"] = time.perf_counter() - began
            tracker.log(step, metrics)
    finally:
        tracker.close()
    text = summary(output_dir, (first, step, cfg.trainer.total_steps), time.perf_counter() - start,
                   cfg.trainer.objective)
    run_folder.write_summary(output_dir, text)
    print(text, file=console_stream(), flush=True)
    return last


def validate(engine: Any, val: Sequence[Any], output_dir: Path, step: int) -> dict[str, float]:
    """The held-out metrics (`validation_metrics`) and their score distribution (scores.png)."""
    chosen, rejected = engine.scores(val)
    plot_scores(output_dir / SCORES_PLOT, chosen, rejected, step)
    return validation_metrics(chosen, rejected, val)


def save(engine: Any, tokenizer: Any, train: Sequence[Any], cfg: DictConfig, output_dir: Path, step: int,
         loader: PromptLoader, best: Optional[dict[str, Any]], fingerprint: dict[str, Any], is_best: bool) -> Path:
    """checkpoints/global_step_N, committed atomically: reward_model/ (the HF folder with score_stats.json
    of the current model's scores on every training pair), state/ (DCP shards, trainer.json, rng.pt,
    config.yaml)."""
    chosen, rejected = engine.scores(train)
    staging = checkpoint.begin(output_dir, step)
    engine.save_hf(staging / ROLE, tokenizer, score_statistics(torch.cat([chosen, rejected])))
    engine.save_state(staging / "state" / ROLE)
    checkpoint.write_manifest(staging, ROLE, 0, [ROLE, f"state/{ROLE}"])
    state = {"step": step, "loader": loader.state_dict(), "best": best, "train_data": fingerprint}
    checkpoint.save_trainer_state(staging / "state", state, {"torch": torch.get_rng_state()},
                                  run_folder.resolved_config(cfg))
    folder = checkpoint.commit(output_dir, step, cfg.trainer.keep_last, {ROLE: 1}, best=is_best)
    log.info("saved %s", shown_path(folder))
    return folder
