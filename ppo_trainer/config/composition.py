"""Composition: the YAML tree in configs/ with command-line overrides, checked and validated;
a grid sweep's jobs composed up front; a config a run saved, read back under today's keys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_trainer.config.overrides import check_overrides, normalize_overrides, sweep_file
from ppo_trainer.config.schema import ADDED_KEYS, CONFIG_DIR, CONFIG_NAME, MOVED_KEYS, ConfigError
from ppo_trainer.config.validation import validate_static

log = logging.getLogger("ppo_trainer")

MAX_CHECKED_JOBS = 256  # a larger grid has its first jobs checked up front, the rest as they start


def check_grid_sweep(overrides: list[str]) -> None:
    """Before a basic (grid) sweep starts, compose and validate each job's config (the first
    MAX_CHECKED_JOBS): a value out of range stops the command with exit 2 instead of ending the sweep
    at its job. Sweepers that pick values as they go (Optuna) are left alone: the CLI scores a
    trial with a bad value NaN."""
    from itertools import islice, product

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    sweepers, params = set(), {}
    for override in parsed:
        if override.key_or_group == "hydra/sweeper":
            sweepers.add(override.get_value_element_as_str())
        elif override.key_or_group == "sweep":
            sweeper, file_params = sweep_file(override.get_value_element_as_str())
            sweepers.add(sweeper or "basic")
            params.update(file_params)
    if sweepers - {"basic"}:
        return
    axes, fixed, on_command_line = {}, [], set()
    for override in parsed:
        key = override.key_or_group
        if key.startswith("hydra") or key == "sweep" or override.package is not None:
            continue
        on_command_line.add(key)
        if override.is_sweep_override():
            axes[key] = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
        else:
            fixed.append(override.input_line)
    for key, value in params.items():  # a key on the command line, swept or not, replaces the file's sweep
        if key not in on_command_line:
            axes[key] = [f"{key}={v}" for v in parser.parse_overrides([f"{key}={value}"])[0].sweep_string_iterator()]
    for number, job in enumerate(islice(product(*axes.values()), MAX_CHECKED_JOBS) if axes else []):
        try:
            compose([*fixed, *job])
        except ConfigError as e:
            raise ConfigError(f"sweep job {number} ({' '.join(job)}): {e}") from None


def compose(overrides: list[str]) -> DictConfig:
    """Compose and statically validate a config without Hydra's run machinery (tests, ppo-eval)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    overrides = normalize_overrides(overrides)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    return validate_static(cfg)


_ABSENT = object()
_REPORTED: set[Path] = set()  # saved configs whose moved keys were printed: ppo-eval reads one twice


def load_saved(path: Path) -> Any:
    """The config a run saved (its config.yaml, a checkpoint's state/config.yaml) with each key that
    has moved since (`MOVED_KEYS`) at its new place, and one line saying so, and each key added since
    (`ADDED_KEYS`) at the value the run had: an older run folder resumes with no spurious change and
    evaluates. The one reader of saved configs; what OmegaConf raises on an unreadable file, and a
    file that holds no mapping, are the caller's to report."""
    config = OmegaConf.load(path)
    if not isinstance(config, DictConfig):
        return config
    for key, value in ADDED_KEYS.items():
        if OmegaConf.select(config, key, default=_ABSENT) is _ABSENT:
            OmegaConf.update(config, key, value)
    moved = [(old, new) for old, new in MOVED_KEYS.items()
             if OmegaConf.select(config, old, default=_ABSENT) is not _ABSENT]
    for old, new in moved:
        parent, _, leaf = old.rpartition(".")
        OmegaConf.update(config, new, OmegaConf.select(config, parent).pop(leaf), merge=False)
    if moved and Path(path).resolve() not in _REPORTED:
        _REPORTED.add(Path(path).resolve())
        log.info("config: %s was saved with keys that have moved since; read at their new places: %s", path,
                 ", ".join(f"{old} -> {new}" for old, new in moved))
    return config
