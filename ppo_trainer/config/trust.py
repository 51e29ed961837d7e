"""What in a config runs code, and what a run folder from elsewhere may set: `ppo-eval` of a run's
checkpoint reads the run's config, but never takes from it a key that runs code or chooses where
files go unless the command line names it (README "Trust")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ppo_trainer.config.composition import load_saved
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.config.validation import validate_static

logger = logging.getLogger("ppo_trainer")

# Keys that name code `ppo-eval` would run (a reward function: a module or a file).
CODE_KEYS = ("reward.fn", "eval.reward_fn")


def is_builtin(ref: str) -> bool:
    """Whether the function reference `ref` ("module:function") names a function of this package by
    module path (not a file that could lie anywhere, e.g. "ppo_trainer.x/../../evil.py:f")."""
    target = ref.rpartition(":")[0]
    is_path = target.endswith(".py") or "/" in target
    return not is_path and (target == "ppo_trainer" or target.startswith("ppo_trainer."))


# Keys a run folder's stored config never sets for ppo-eval (a folder from elsewhere must not run
# code or choose where files go): they come from the command line or the defaults.
NOT_FROM_RUN_FOLDER = ("model.trust_remote_code", "reward.model.trust_remote_code", "trainer.output_dir",
                       "eval.output_file")


def eval_config(composed: Any, overrides: list[str], run_config: Optional[Path]) -> Any:
    """The run's config (`run_config`, a saved config.yaml) with each key or group that `overrides` name taken from
    `composed`, and `NOT_FROM_RUN_FOLDER` always. A `reward.fn` outside ppo_trainer runs only when the
    command line names it: else ConfigError."""
    if run_config is None:
        return composed
    cfg = load_saved(run_config)
    named = [override.key_or_group for override in OverridesParser.create().parse_overrides(overrides)]
    if "experiment" in named:
        raise ConfigError(f"+experiment does not apply to a checkpoint: {run_config} gives the run's "
                          "settings; override single keys instead")
    remote_code = ("model.trust_remote_code" not in named and OmegaConf.select(cfg, "model.trust_remote_code") is True)
    also = (" (and its model.trust_remote_code=true is not taken either: pass model.trust_remote_code=true too if "
            "you trust the folder)") if remote_code else ""
    for key in CODE_KEYS:
        stored_fn = OmegaConf.select(cfg, key)
        if stored_fn is None or any(name in (key, key.partition(".")[0]) for name in named) or is_builtin(stored_fn):
            continue
        raise ConfigError(f"the run's config ({run_config}) names {key}={stored_fn}, code that ppo-eval does not "
                          f"run from a run folder unless told to: pass {key}={stored_fn} on the command line to "
                          f"trust it, or another {key}{also}")
    if remote_code:
        logger.warning("eval: the run's config sets model.trust_remote_code=true; ppo-eval does not take it from a "
                       "run folder (pass model.trust_remote_code=true to run the model folder's code)")
    for key in [*named, *NOT_FROM_RUN_FOLDER]:
        OmegaConf.update(cfg, key, OmegaConf.select(composed, key), merge=False)
    return validate_static(cfg)
