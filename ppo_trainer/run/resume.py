"""What a resume keeps, applies and refuses (README "Resume"). The run's config is compared with the
one its checkpoint was trained with, key by key: a key on `REFUSED` would make the checkpoint
continue a different run and stops the start (exit 2) unless `trainer.resume_allow` names it; every
other change is printed and applied (the engines set the config's optimizer values on the restored
optimizer, the KL controller restarts from a changed `gae.kl_coef`). A changed reward is printed and
restarts the normalisation of the parts it changes; statistics that are not finite are refused."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config.composition import load_saved
from ppo_trainer.config.paths import absolute_paths
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.tracking import flatten

log = logging.getLogger("ppo_trainer")

# Keys (a key names its subtree too) whose change makes the checkpoint continue something else: another
# model, another LoRA shape, other training prompts or another order of them, other batch sizes, another
# advantage estimator (a critic-free checkpoint holds no critic to continue; a critic's would be dropped), another
# environment or tool set (another task), another lag of the samples behind the policy (the rollouts in flight
# at the checkpoint were generated for its schedule: sampler.max_staleness, sampler.partial_rollouts).
REFUSED = (
    "model.path", "critic.path", "model.lora.rank", "model.lora.target_modules", "critic.lora.rank",
    "critic.lora.target_modules", "algorithm.adv_estimator",
    "data.source", "data.hub_config", "data.train_split", "data.train_files", "data.train_weights",
    "data.prompt_key", "data.answer_key", "data.source_key", "data.shuffle", "data.train_batch_size",
    "data.arithmetic.train_size", "data.arithmetic.max_operand", "data.arithmetic.two_step_fraction",
    "data.arithmetic.operations",
    "data.arithmetic.seed", "data.digits.task", "data.digits.min_length", "data.digits.length",
    "data.digits.train_size", "data.digits.seed",
    "sampler.n", "sampler.multi_turn.env", "sampler.multi_turn.tools", "sampler.max_staleness",
    "sampler.partial_rollouts", "trainer.seed", "algorithm.filter_groups", "algorithm.filter_groups_metric",
    "algorithm.filter_groups_max_draws",
)
NOT_COMPARED = ("trainer.output_dir", "trainer.resume", "trainer.resume_allow", "trainer.dry_run")
KL_CONTROLLER_KEYS = ("gae.kl_coef", "gae.kl_ctrl")  # a change restarts the controller from gae.kl_coef
# An entry of the reward's fingerprint (scoring.reward_fingerprint) -> the learned parts whose normalisation
# statistics start over when it changes. A function's score is not normalised: its change resets nothing.
REWARD_RESETS = {"reward.fn": (), "eval.reward_fn": (), "reward.model.path": ("model",),
                 "reward.remote.url": ("remote",)}
_ABSENT = object()

Change = tuple[str, Any, Any]  # (dotted key, value at the checkpoint, value now)


def _covers(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def config_changes(saved: DictConfig, current: DictConfig) -> list[Change]:
    """Every leaf key whose value differs between the two configs, sorted by key (dtypes as
    configured: `auto` stays `auto`; `NOT_COMPARED` left out), their paths compared absolute
    (`config.paths.absolute_paths`: a path typed relative is the one a run saved absolute, and a
    relative one an older version saved is read against the working folder, as that run read it)."""
    old = flatten(OmegaConf.to_container(absolute_paths(copy.deepcopy(saved)), resolve=True))
    new = flatten(OmegaConf.to_container(absolute_paths(copy.deepcopy(current)), resolve=True))
    keys = sorted(k for k in old.keys() | new.keys() if not any(_covers(p, k) for p in NOT_COMPARED))
    return [(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys if old.get(k, _ABSENT) != new.get(k, _ABSENT)]


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    return value if isinstance(value, str) else json.dumps(value)


def check_config(checkpoint: Path, saved: DictConfig, state: dict[str, Any], cfg: DictConfig,
                 refused_keys: Sequence[str] = REFUSED) -> list[Change]:
    """The changes since the checkpoint (`saved`: the config it was trained with), each printed as
    `resume: changed since step N: KEY OLD -> NEW`. ConfigError (one line, before any model loads)
    listing the refused ones (`refused_keys`: ppo-train's `REFUSED`, or ppo-train-rm's) not in
    trainer.resume_allow."""
    step = int(state["step"])
    changes = config_changes(saved, cfg)
    allowed = list(cfg.trainer.resume_allow)
    refused = [c for c in changes if any(_covers(r, c[0]) for r in refused_keys)
               and not any(_covers(a, c[0]) for a in allowed)]
    if refused:
        listed = "; ".join(f"{key} {_show(old)} -> {_show(new)}" for key, old, new in refused)
        keys = ",".join(key for key, _, _ in refused)
        raise ConfigError(
            f"resume from {checkpoint} refused: {listed} would continue a different run than the checkpoint's. "
            f"Keep both with another trainer.output_dir, start over here with trainer.resume=never (the old run is "
            f"moved aside), or accept the change knowingly with trainer.resume_allow=[{keys}]")
    for key, old, new in changes:
        log.info("resume: changed since step %d: %s %s -> %s", step, key, _show(old), _show(new))
    return changes


def check_unsaved_run(output_dir: Path, cfg: DictConfig) -> None:
    """`trainer.resume=auto` over a folder whose run of another model saved no checkpoint: ConfigError
    (starting here would overwrite that run's config.yaml and metrics)."""
    saved = output_dir / "config.yaml"
    try:
        old_model = OmegaConf.select(absolute_paths(load_saved(saved)), "model.path") if saved.is_file() else None
    except Exception as e:  # noqa: BLE001  (OmegaConf raises yaml's and its own errors)
        raise ConfigError(f"trainer.output_dir={output_dir} holds a config.yaml that cannot be read "
                          f"({type(e).__name__}); choose another trainer.output_dir, or start over here with "
                          "trainer.resume=never (the old run is moved aside)") from None
    if old_model is not None and old_model != cfg.model.path:
        raise ConfigError(f"trainer.output_dir={output_dir} holds a run of model.path={old_model}, not "
                          f"{cfg.model.path}; choose another trainer.output_dir, or start over here with "
                          "trainer.resume=never (the old run is moved aside)")


def check_dtypes(state: dict[str, Any], resolved: dict[str, str]) -> None:
    """Print a role whose compute dtype resolves differently here than when the checkpoint was saved
    (`dtype=auto` on another CPU): not refused, the weights are float32 masters either way."""
    for role, dtype in resolved.items():
        before = state["dtypes"].get(role)
        if before is not None and before != dtype:
            log.info("resume: the %s computes in %s here, in %s when step %d was saved (dtype=auto on another "
                     "device)", role, dtype, before, state["step"])


def restores_kl_controller(changes: Sequence[Change]) -> bool:
    """Whether the checkpoint's KL coefficient continues, or the controller restarts from gae.kl_coef."""
    return not any(key in KL_CONTROLLER_KEYS for key, _, _ in changes)


def data_fingerprint(records: Sequence[Any]) -> dict[str, Any]:
    """{"records", "sha256"} of the training prompts (source, row index, question, ground truth), in load order."""
    digest = hashlib.sha256()
    for r in records:
        digest.update(json.dumps([r.data_source, r.index, r.question, r.ground_truth], default=str).encode())
    return {"records": len(records), "sha256": digest.hexdigest()}


def check_train_data(state: dict[str, Any], fingerprint: dict[str, Any], changes: Sequence[Change],
                     cfg: DictConfig) -> None:
    """ConfigError when the training prompts differ from the checkpoint's (a changed filter such as
    data.max_prompt_length, an edited file), unless trainer.resume_allow names a data key."""
    before = state["train_data"]
    if before == fingerprint:
        return
    data_keys = [f"{key} {_show(old)} -> {_show(new)}" for key, old, new in changes if key.startswith("data.")]
    if any(a.startswith("data") for a in cfg.trainer.resume_allow):
        log.info("resume: the training prompts differ from step %d's (%d -> %d records; trainer.resume_allow)",
                 state["step"], before["records"], fingerprint["records"])
        return
    cause = f" after {'; '.join(data_keys)}" if data_keys else " (the files' contents changed)"
    raise ConfigError(
        f"resume refused: the training prompts differ from those of step {state['step']} ({before['records']} -> "
        f"{fingerprint['records']} records){cause}, so the saved data position means other prompts. Use another "
        f"trainer.output_dir, trainer.resume=never, or accept it with trainer.resume_allow=[data]")


def reset_reward_parts(state: dict[str, Any], fingerprint: Mapping[str, Any]) -> set[str]:
    """The learned parts whose normalisation statistics start over (`REWARD_RESETS`): each entry of the
    reward's fingerprint that differs from the checkpoint's is printed as `resume: the reward changed
    since step N: KEY OLD -> NEW; ...`. A checkpoint written before checkpoints stored it: nothing."""
    before = state.get("reward_fingerprint")
    if before is None:
        return set()
    reset: set[str] = set()
    for key, now in fingerprint.items():
        if before.get(key) != now:
            parts = REWARD_RESETS.get(key, ())
            what = (f"the {' and '.join(parts)} score's normalisation statistics start over" if parts
                    else "nothing to reset (a function's score is not normalised)")
            log.info("resume: the reward changed since step %d: %s %s -> %s; %s", state["step"], key,
                     _show(before.get(key)), _show(now), what)
            reset |= set(parts)
    return reset


def nonfinite_statistics(reward_norm: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The reward normalisation statistics that are not finite numbers (JSON's NaN and Infinity
    included), by their key in the trainer state: {"reward_norm.<part>.<name>": value}."""
    return {f"reward_norm.{part}.{name}": value for part, stats in reward_norm.items() for name, value in stats.items()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)}


def restored_reward_norm(checkpoint: Path, state: dict[str, Any], fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's reward normalisation statistics a resume restores: all but those of the parts
    whose reward changed (`reset_reward_parts`). CheckpointError (exit 2, before any model loads) for a
    restored statistic that is not finite, naming the file and key, with the ways out: the newest
    earlier checkpoint whose statistics are finite, or deleting the part's entry from the file."""
    from ppo_trainer.run.checkpoint import CheckpointError, complete_steps, step_dir

    reset = reset_reward_parts(state, fingerprint)
    kept = {part: stats for part, stats in state["reward_norm"].items() if part not in reset}
    bad = nonfinite_statistics(kept)
    if not bad:
        return kept
    file, step = checkpoint / "state" / "trainer.json", int(state["step"])
    parts = sorted({key.split(".")[1] for key in bad})
    output_dir = checkpoint.parent.parent
    earlier = [s for s in complete_steps(output_dir) if s < step and _finite_at(step_dir(output_dir, s), parts)]
    way = (f"Resume from step {earlier[-1]}, whose statistics are finite, with trainer.resume="
           f"{step_dir(output_dir, earlier[-1])}" if earlier else "Start over with trainer.resume=never")
    shown = ", ".join(f"{key} is {value}" for key, value in bad.items())
    raise CheckpointError(
        f"{file}: {shown}, not a finite number, so the reward normalisation of step {step} cannot continue. {way}; "
        f"or keep this step and restart that normalisation from the next batch by deleting "
        f"{' and '.join(repr(p) for p in parts)} from \"reward_norm\" in {file}")


def _finite_at(checkpoint: Path, parts: Sequence[str]) -> bool:
    """Whether a checkpoint's saved statistics of `parts` are finite (False where they cannot be read)."""
    try:
        saved = json.loads((checkpoint / "state" / "trainer.json").read_text())["reward_norm"]
        return not nonfinite_statistics({part: stats for part, stats in saved.items() if part in parts})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
