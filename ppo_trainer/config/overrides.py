"""Command-line overrides checked against the schema before Hydra composes: unknown keys (with the
nearest valid one), values of the wrong type, unknown group options, sweepers and sweep files.
Hydra alone would let `+gae.gama=0.9` add a key."""

from __future__ import annotations

import difflib
import re
from dataclasses import is_dataclass
from typing import Any, Optional, get_origin

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_trainer.config.schema import (
    CONFIG_DIR,
    MOVED_KEYS,
    ConfigError,
    PPOConfig,
    config_groups,
    group_options,
    schema_keys,
)

_KEYS = schema_keys()


# verl's nested spellings of keys that are flat here (docs/from-verl.md). Not MOVED_KEYS: no run of this
# trainer saved them, so a saved config never needs them rewritten.
VERL_KEYS = {"algorithm.filter_groups.enable": "algorithm.filter_groups",
             "algorithm.filter_groups.metric": "algorithm.filter_groups_metric",
             "algorithm.filter_groups.max_num_gen_batches": "algorithm.filter_groups_max_draws"}


def unknown_key_error(key: str) -> ConfigError:
    """One line for a key the schema does not have: verl's spelling of one (`VERL_KEYS`), where it moved
    (`MOVED_KEYS`), else the nearest valid key."""
    if key in VERL_KEYS:
        return ConfigError(f"unknown config key '{key}': verl's spelling; write {VERL_KEYS[key]}=...")
    moved = next((old for old in MOVED_KEYS if key == old or key.startswith(old + ".")), None)
    if moved is not None:
        return ConfigError(f"unknown config key '{key}': '{moved}' moved to '{MOVED_KEYS[moved]}' (verl's spelling, "
                           f"like the actor's model.optim); write {MOVED_KEYS[moved]}{key[len(moved):]}=...")
    parent, _, leaf = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in _KEYS if k.rpartition(".")[0] == parent)
    if not siblings:
        top = sorted(k for k in _KEYS if "." not in k)
        return ConfigError(f"unknown config key '{key}': top-level groups are {', '.join(top)}")
    close = difflib.get_close_matches(leaf, siblings, n=1)
    hint = f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}; valid keys under '{parent}': {', '.join(siblings)}")


def check_key(key: str) -> None:
    """Raise ConfigError unless the dotted `key` is a schema field or in a list/dict one (data.train_files.0)."""
    parts = key.split(".")
    heads = (".".join(parts[:i]) for i in range(1, len(parts)))
    if key not in _KEYS and not any(get_origin(_KEYS.get(head)) in (list, dict) for head in heads):
        raise unknown_key_error(key)


def check_value(key: str, value: Any) -> None:
    """Raise ConfigError if `value` cannot be assigned to the schema field `key` (type check only)."""
    try:
        OmegaConf.update(OmegaConf.structured(PPOConfig), key, value, merge=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid value for '{key}': {str(e).splitlines()[0]}") from None
    except (IndexError, KeyError):
        return  # list elements by index are checked when the composed config is validated


_FILE_LIST_KEY = re.compile(r"^(\+*data\.(?:train|val)_files)=([^\[].*)$")  # a single path, not [...]
_OPEN_DICT_KEY = re.compile(r"^\+*(data\.chat_template_kwargs(?:\.[^=]+)?=)")  # its keys are the template's
_IPV6_RAY_ADDRESS = re.compile(r"^(\+*devices\.ray\.address=)(\[[\w:.%]+\]:\d+)$")  # [::1]:6379


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Accept a single path for the list-typed file keys: `data.val_files=test.jsonl` -> `[test.jsonl]`;
    let `data.chat_template_kwargs={k: v}` and `data.chat_template_kwargs.k=v` add keys (`++`), which
    Hydra's struct mode would refuse without a `+`; take `devices.ray.address=[::1]:6379` (Ray's
    IPv6 form) as the string it is, not as a list Hydra cannot parse."""
    return [_IPV6_RAY_ADDRESS.sub(r"\1'\2'", _OPEN_DICT_KEY.sub(r"++\1", _FILE_LIST_KEY.sub(r"\1=[\2]", override)))
            for override in overrides]


def check_overrides(overrides: list[str]) -> None:
    """Check overrides against the schema and group options: Hydra lets `+gae.gama=0.9` add a key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"cannot parse override: {str(e).splitlines()[0]}") from None
    groups = config_groups()
    for override in parsed:
        key = override.key_or_group
        if key.startswith("hydra") or override.package is not None:
            if key == "hydra/sweeper" and not override.is_delete():
                check_sweeper(override.get_value_element_as_str())
            continue
        if key in groups:
            if override.is_delete():
                continue
            options = group_options(key)
            values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
            for value in values:
                if value not in options:
                    prefix = "+" if key in ("experiment", "sweep") else ""
                    raise ConfigError(f"unknown option '{prefix}{key}={value}'; available: {', '.join(options)}")
                if key == "sweep":
                    check_sweep_file(value)
            continue
        if is_dataclass(_KEYS.get(key)) and isinstance(override.value(), str):  # e.g. critic=default: no options
            options = ", ".join(g for g in groups if g not in ("experiment", "sweep"))
            raise ConfigError(f"unknown option '{override.input_line.lstrip('+~')}'; '{key}' has no options (the "
                              f"groups with options: {options}); set its keys instead, e.g. "
                              f"{next(k for k in _KEYS if k.startswith(key + '.'))}=...")
        check_key(key)
        if not override.is_delete():
            for value in _assigned_values(override):
                check_value(key, value)


def _assigned_values(override: Any) -> list[Any]:
    """The values an override may assign: each of a choice or range sweep, an interval's bounds, none for a glob."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return list(value.list)
    if isinstance(value, RangeSweep):
        return list(override.sweep_iterator())
    if isinstance(value, IntervalSweep):
        return [value.start, value.end]
    return [] if override.is_sweep_override() else [value]


def installed_sweepers() -> set[str]:
    """The hydra/sweeper options Hydra finds: its own `basic` and those of installed plugins."""
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports the installed hydra_plugins, which register their sweeper configs
    return {name[: -len(".yaml")] for name in ConfigStore.instance().list("hydra/sweeper") if name.endswith(".yaml")}


def check_sweeper(name: str) -> None:
    if name not in installed_sweepers():
        hint = "pip install 'ppo-trainer[optuna]'" if name == "optuna" else "install the Hydra plugin that provides it"
        raise ConfigError(f"hydra/sweeper={name} is not installed: {hint}")


def sweep_file(name: str) -> tuple[Optional[str], dict[str, Any]]:
    """configs/sweep/NAME.yaml: (the hydra/sweeper option its defaults pick, or None; its
    hydra.sweeper.params)."""
    sweep = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "sweep" / f"{name}.yaml"))
    sweeper = next((str(option) for entry in sweep.get("defaults") or [] if isinstance(entry, dict)
                    for group, option in entry.items() if group.split()[-1].strip("/") == "hydra/sweeper"), None)
    return sweeper, ((sweep.get("hydra") or {}).get("sweeper") or {}).get("params") or {}


def check_sweep_file(name: str) -> None:
    """configs/sweep/NAME.yaml: its sweeper is installed, its hydra.sweeper.params pass check_overrides."""
    sweeper, params = sweep_file(name)
    if sweeper is not None:
        check_sweeper(sweeper)
    try:
        check_overrides([f"{key}={value}" for key, value in params.items()])
    except ConfigError as e:
        raise ConfigError(f"configs/sweep/{name}.yaml, hydra.sweeper.params: {e}") from None
