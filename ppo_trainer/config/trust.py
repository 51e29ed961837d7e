"""What in a config runs code, and what a run folder from elsewhere may set: `ppo-eval` of a run's
checkpoint reads the run's config, but never takes from it a key that runs code or chooses where
files go unless the command line names it (README "Trust")."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ppo_trainer.config.composition import load_saved
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.config.validation import validate_static

logger = logging.getLogger("ppo_trainer")

# Keys that name code a run imports and runs, each a function reference ("package.module:function" or
# "path/to/file.py:function"). The one list: the trust rule below, the absolute paths a run saves
# (`config.paths`) and the ppo-eval command of the run's summary (`code_overrides`) read it; a feature
# that adds a key naming code (an environment, a tool) adds it here.
CODE_KEYS = ("reward.fn", "eval.reward_fn", "sampler.multi_turn.env", "sampler.multi_turn.tools")
# Built-in tools go by bare name (sampler.multi_turn.tools=[calculator]): ppo_trainer's own code
BUILTIN_TOOLS = ("calculator", "python")


def code_refs(value: Any) -> list[str]:
    """The function references a code key's value holds: none, one, or a list's (sampler.multi_turn.tools)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [str(value)]


def function_file(ref: str) -> Optional[str]:
    """The file of a function reference "path/to/file.py:function" (a path: it ends in .py or holds
    a "/"), None for a module reference "package.module:function"."""
    target = ref.rpartition(":")[0]
    return target if target.endswith(".py") or "/" in target else None


def is_builtin(ref: str) -> bool:
    """Whether the function reference `ref` ("module:function") names a function of this package by
    module path (not a file that could lie anywhere, e.g. "ppo_trainer.x/../../evil.py:f")."""
    if ref in BUILTIN_TOOLS:
        return True
    target = ref.rpartition(":")[0]
    return function_file(ref) is None and (target == "ppo_trainer" or target.startswith("ppo_trainer."))


_UNQUOTED = re.compile(r"[A-Za-z0-9_/.:+@%-]+")  # characters Hydra's override grammar reads unquoted


def code_overrides(cfg: Any) -> list[str]:
    """`key=value` for each code key of `cfg` (`CODE_KEYS`) that is set and not built in: what the
    command line of `ppo-eval` must name to evaluate a checkpoint of this run (`eval_config` runs
    no code a run folder names). A value Hydra would not read as it is comes in Hydra's quotes."""
    def quoted(ref: str) -> str:
        return ref if _UNQUOTED.fullmatch(ref) else "'" + ref.replace("\\", "\\\\").replace("'", "\\'") + "'"

    overrides = []
    for key in CODE_KEYS:
        value = OmegaConf.select(cfg, key)
        refs = code_refs(value)
        if any(not is_builtin(ref) for ref in refs):
            listed = isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
            overrides.append(f"{key}=[{','.join(map(quoted, refs))}]" if listed else f"{key}={quoted(refs[0])}")
    return overrides


# Keys a run folder's stored config never sets for ppo-eval (a folder from elsewhere must not run
# code or choose where files go): they come from the command line or the defaults.
NOT_FROM_RUN_FOLDER = ("model.trust_remote_code", "reward.model.trust_remote_code", "trainer.output_dir",
                       "eval.output_file")


def check_saved_files(cfg: Any, run_config: Path) -> None:
    """ConfigError naming the first of the run's data.val_files that is not here, the config file it
    came from and what to do. A run saves them absolute (`config.paths`); an older version saved them
    as typed, and those are read against the current folder, as the run read them."""
    for path in OmegaConf.select(cfg, "data.val_files") or []:
        if not Path(path).expanduser().is_file():
            older = "" if os.path.isabs(path) else " (saved relative by an older version: read here)"
            raise ConfigError(f"data.val_files: {path}{older} does not exist; it came from the run's config "
                              f"({run_config}): pass data.val_files=[...] with files that are here, or put the file "
                              "back where the run read it")


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
        value = OmegaConf.select(cfg, key)
        stored = code_refs(value)
        if not stored or any(name in (key, key.partition(".")[0]) for name in named) or all(map(is_builtin, stored)):
            continue
        shown = f"[{','.join(stored)}]" if OmegaConf.is_list(value) else stored[0]
        raise ConfigError(f"the run's config ({run_config}) names {key}={shown}, code that ppo-eval does not "
                          f"run from a run folder unless told to: pass {key}={shown} on the command line to "
                          f"trust it, or another {key}{also}")
    if not any(name in ("data", "data.val_files") for name in named):
        check_saved_files(cfg, run_config)
    if remote_code:
        logger.warning("eval: the run's config sets model.trust_remote_code=true; ppo-eval does not take it from a "
                       "run folder (pass model.trust_remote_code=true to run the model folder's code)")
    for key in [*named, *NOT_FROM_RUN_FOLDER]:
        OmegaConf.update(cfg, key, OmegaConf.select(composed, key), merge=False)
    return validate_static(cfg)
