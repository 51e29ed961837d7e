"""A run's checkpoint as the trainer writes and reads it: the resume checked before any model loads
(`prepare_resume`, `check_resumed_data`), every role's part and the trainer's own state saved
(`save`), and a run continued exactly where a checkpoint left it (`load`). The trainer is the
`trainer.Trainer` of the run; only its groups, loader, controllers and counters are touched."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import DictConfig

from ppo_trainer.config.derived import trained_roles
from ppo_trainer.console import finished_text, shown_path
from ppo_trainer.data import PromptLoader, PromptRecord
from ppo_trainer.dtypes import resolve_dtype
from ppo_trainer.rewards.scoring import reward_fingerprint
from ppo_trainer.run import checkpoint, resume
from ppo_trainer.run import folder as run_folder
from ppo_trainer.tracking import metric_series, read_jsonl
from ppo_trainer.workers.accelerators import detect
from ppo_trainer.workers.cluster.nodes import remove_marker, write_marker
from ppo_trainer.workers.roles import Worker

log = logging.getLogger("ppo_trainer")
ROLLOUTS_FILE = "rollouts.pt"  # state/: the rollouts generated ahead of the step (sampler.max_staleness >= 1)


@dataclass
class Resume:
    """A checked resume: the checkpoint folder, its trainer state and RNG states, and the config
    changes since it was saved (`resume.check_config`)."""

    folder: Path
    state: dict[str, Any]
    rng: dict[str, Any]
    changes: list[resume.Change] = field(default_factory=list)


def resolved_dtypes(cfg: DictConfig) -> dict[str, str]:
    """The compute dtype each trained role resolves to on this machine (`dtype=auto` follows the device)."""
    device_type = detect(cfg.devices.accelerator).torch_device_type
    keys = {"actor": cfg.model.dtype, "critic": cfg.critic.dtype}
    return {role: resolve_dtype(keys[role], device_type) for role in trained_roles(cfg)}


def prepare_resume(cfg: DictConfig, output_dir: Path) -> Optional[Resume]:
    """`trainer.resume` decided before any model loads: `never` moves the previous run aside; a
    checkpoint to continue is checked against the config (refused changes stop here: ConfigError),
    its dtypes and its reward statistics. None when the run starts from scratch."""
    if cfg.trainer.resume == "never":
        run_folder.move_previous_run(output_dir)
    folder = checkpoint.resolve_resume(output_dir, cfg.trainer.resume)
    if folder is None:
        if cfg.trainer.resume == "auto":
            resume.check_unsaved_run(output_dir, cfg)
        return None
    saved = checkpoint.saved_config(folder)
    state, rng = checkpoint.load_trainer_state(folder / "state", trained_roles(saved))  # the roles it trained
    changes = resume.check_config(folder, saved, state, run_folder.resolved_config(cfg))
    resume.check_dtypes(state, resolved_dtypes(cfg))
    state["reward_norm"] = resume.restored_reward_norm(folder, state, reward_fingerprint(cfg))
    return Resume(folder, state, rng, changes)


def finished_run(cfg: DictConfig, output_dir: Path) -> Optional[tuple[str, Optional[float]]]:
    """(what to print, the last trainer.objective value) when the checkpoint this command would
    continue is at trainer.total_steps already: its run's summary.txt, else one line with the last
    objective of its metrics.jsonl. Read before any model loads; None when there is a step to train
    (a raised trainer.total_steps continues the run)."""
    folder = None if cfg.trainer.resume == "never" else checkpoint.resolve_resume(output_dir, cfg.trainer.resume)
    if folder is None:
        return None
    step = int(checkpoint.load_trainer_state(folder / "state", ("actor",))[0]["step"])  # every checkpoint has an actor
    if step < cfg.trainer.total_steps:
        return None
    run = folder.parent.parent
    points = metric_series(read_jsonl(run / "metrics.jsonl"), cfg.trainer.objective)
    last = points[-1] if points else (None, None)
    summary = run / run_folder.SUMMARY_FILE
    text = finished_text(folder, step, cfg.trainer.total_steps, summary if summary.is_file() else None,
                         cfg.trainer.objective, last)
    return text, last[1]


def check_resumed_data(resumed: Resume, train_records: Sequence[PromptRecord], cfg: DictConfig) -> None:
    """The training prompts are the checkpoint's (`resume.check_train_data`), and its saved data
    position fits them (trainer.resume_allow may have let them change): else an error, before any
    model loads."""
    resume.check_train_data(resumed.state, resume.data_fingerprint(train_records), resumed.changes, cfg)
    try:
        PromptLoader.from_config(cfg, train_records).load_state_dict(resumed.state["loader"])
    except ValueError as e:
        raise checkpoint.CheckpointError(f"{resumed.folder}: the saved data position does not fit the training "
                                         f"prompts ({e}); start over with trainer.resume=never") from None


def save(trainer: Any, best: bool = False) -> Path:
    """Write checkpoints/global_step_N atomically (`checkpoint.commit`), with the config it was trained
    with. A failure to write (a full disk) is a CheckpointSaveError naming the last complete step; a
    worker that does not see the staged folder (its marker) stops the save before anything is written."""
    reward = trainer.scorer.saved_state(trainer.step, trainer.last_checkpoint_line)  # finite, or nothing is written
    try:
        staging = checkpoint.begin(trainer.output_dir, trainer.step)
        marker = write_marker(staging)
        trainer.actor.run_all(Worker.save, str(staging), marker)
        if trainer.critic is not None:  # none with a critic-free algorithm.adv_estimator
            trainer.critic.run_all(Worker.save, str(staging), marker)
        remove_marker(staging)
        state = {"step": trainer.step, "loader": trainer.loader.state_dict(), "kl_ctrl": trainer.kl_ctrl.state_dict(),
                 "critic_warmup": trainer.critic_warmup.state_dict(),
                 "nonfinite_streak": trainer.nonfinite_streak, "best": trainer.best,
                 "dtypes": resolved_dtypes(trainer.cfg), "train_data": trainer.train_data, **reward}
        workers = {role: group.run_all(Worker.rng_state) for role, group in trainer.groups.items()}
        checkpoint.save_trainer_state(staging / "state", state,
                                      {"torch": torch.get_rng_state(), "workers": workers},
                                      run_folder.resolved_config(trainer.cfg))
        in_flight = trainer.rollouts.state()  # sampler.max_staleness >= 1: generated ahead, trained on first at resume
        if in_flight:
            torch.save(in_flight, staging / "state" / ROLLOUTS_FILE)
        folder = checkpoint.commit(trainer.output_dir, trainer.step, trainer.cfg.trainer.keep_last,
                                   parts={role: len(trainer.groups[role]) for role in trained_roles(trainer.cfg)},
                                   best=best)
    except OSError as e:
        raise checkpoint.CheckpointSaveError(f"saving step {trainer.step} failed ({e}); free the disk or fix the "
                                             f"folder: {trainer.last_checkpoint_line()}") from e
    log.info("saved %s", shown_path(folder))
    return folder


def load(trainer: Any, resumed: Resume) -> None:
    """Continue `trainer` exactly from a checked resume (`prepare_resume`). The engines keep the
    config's optimizer values; a changed gae.kl_coef or kl_ctrl restarts the KL controller from the
    config's coefficient (`resume.restores_kl_controller`)."""
    folder, state, rng = resumed.folder, resumed.state, resumed.rng
    trainer.actor.run_all(Worker.load, str(folder))
    if trainer.critic is not None and (folder / "state" / "critic").is_dir():
        trainer.critic.run_all(Worker.load, str(folder))
    elif trainer.critic is not None:  # trainer.resume_allow let algorithm.adv_estimator change from a critic-free one
        log.info("resume: %s was trained critic-free and holds no critic; the critic starts anew", shown_path(folder))
    trainer.loader.load_state_dict(state["loader"])
    if resume.restores_kl_controller(resumed.changes):
        trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if "critic_warmup" in state:  # where the warm-up ended, or that it goes on (an earlier release's: by count)
        trainer.critic_warmup.load_state_dict(state["critic_warmup"])
    trainer.nonfinite_streak.update(state["nonfinite_streak"])
    trainer.scorer.load_state_dict(state["reward_norm"])
    for role, group in trainer.groups.items():  # after the loads: building and loading draw numbers too
        saved = rng.get("workers", {}).get(role)
        if saved is not None and len(saved) == len(group):
            group.run_each(Worker.set_rng_state, [(s,) for s in saved])
        else:
            log.warning("%s: no RNG state for %d replicas in the checkpoint; the resume is not bit-exact",
                        role, len(group))
    torch.set_rng_state(rng["torch"])
    trainer.step = int(state["step"])
    trainer.best = state["best"]
    if trainer.best is not None and checkpoint.step_dir(trainer.output_dir, trainer.best["step"]).is_dir():
        checkpoint.write_pointer(trainer.output_dir, "best", trainer.best["step"])
    trainer.sync_rollout_weights()
    in_flight = saved_rollouts(folder)
    try:
        trainer.rollouts.resume_at(trainer.step, in_flight)
    except ValueError as e:
        raise checkpoint.CheckpointError(f"{folder / 'state' / ROLLOUTS_FILE}: {e}; resume from another checkpoint "
                                         "with trainer.resume=PATH") from None
    if trainer.cfg.sampler.max_staleness and not in_flight and trainer.step < trainer.cfg.trainer.total_steps:
        log.info("resume: %s holds no rollouts generated ahead (the run had ended there): steps %d-%d sample with "
                 "step %d's weights, fresher than sampler.max_staleness schedules", shown_path(folder),
                 trainer.step + 1, trainer.step + trainer.cfg.sampler.max_staleness, trainer.step)
    log.info("resumed from %s (step %d)", shown_path(folder), trainer.step)


def saved_rollouts(folder: Path) -> list[dict[str, Any]]:
    """The rollouts a checkpoint holds in flight (`RolloutPipeline.state`), [] where it holds none."""
    path = folder / "state" / ROLLOUTS_FILE
    if not path.is_file():
        return []
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise checkpoint.CheckpointError(f"corrupt rollouts in flight in {path}: {str(e).splitlines()[0]}; resume "
                                         "from another checkpoint with trainer.resume=PATH") from None
