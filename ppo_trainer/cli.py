"""`ppo-train` and `ppo-eval`.

Exit codes: 0 success, 1 a runtime failure, 2 a config or input error (bad key, bad value,
missing file, impossible device request). Hydra's own `@hydra.main` exits 1 on a bad
override, so overrides are checked against the schema before Hydra runs, and any error Hydra
raises before our task starts is reported as a config error too.

Heavy imports (torch, ray, vllm) happen inside the run, never at import time, so a config
error or a dry run answers within seconds.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config import ConfigError, check_key, check_value, register_configs

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_NAME = "ppo"
# Hydra flags that take a value as the next argument.
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                     "--experimental-rerun", "--package", "-p", "--info", "-i"}
# How to install the Hydra sweeper plugins that configs/sweep/ may select.
_SWEEPER_PACKAGES = {"optuna": "pip install 'ppo-trainer[optuna]'"}

log = logging.getLogger("ppo_trainer")


def group_options(group: str) -> list[str]:
    """Option names of a config group (YAML files in configs/<group>/)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def config_groups() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate Hydra's flags (with their values) from `key=value` overrides."""
    flags, overrides = [], []
    it = iter(argv)
    for arg in it:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _FLAGS_WITH_VALUE:
                value = next(it, None)
                if value is not None:
                    flags.append(value)
        else:
            overrides.append(arg)
    return flags, overrides


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Accept a single path for the list-typed file keys: `data.val_files=test.jsonl` -> `[test.jsonl]`."""
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") in ("data.train_files", "data.val_files") and value and not value.startswith("["):
            override = f"{key}=[{value}]"
        out.append(override)
    return out


def check_overrides(overrides: list[str]) -> None:
    """Check every override against the schema and the group options; raise ConfigError.

    Catches what Hydra lets through (`+gae.gama=0.9` adds a key the schema lacks) and turns
    what Hydra would report in several lines into one line with the valid choices.
    """
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
        check_key(key)
        if not override.is_delete():
            for value in _assigned_values(override):
                check_value(key, value)


def _assigned_values(override: Any) -> list[Any]:
    """The values an override may assign: its value, each value of a choice or range sweep, or
    the bounds of an interval (Optuna); none for a glob."""
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
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports the installed hydra_plugins, which register their sweeper configs
    return {name[: -len(".yaml")] for name in ConfigStore.instance().list("hydra/sweeper") if name.endswith(".yaml")}


def check_sweeper(name: str) -> None:
    """Raise ConfigError unless the Hydra sweeper `name` is installed."""
    if name not in installed_sweepers():
        hint = _SWEEPER_PACKAGES.get(name, "install the Hydra plugin that provides it")
        raise ConfigError(f"hydra/sweeper={name} is not installed: {hint}")


def check_sweep_file(name: str) -> None:
    """Check configs/sweep/NAME.yaml before Hydra runs it: the sweeper it selects is installed,
    and its hydra.sweeper.params pass the same checks as command-line overrides."""
    path = CONFIG_DIR / "sweep" / f"{name}.yaml"
    sweep = OmegaConf.to_container(OmegaConf.load(path))
    for entry in sweep.get("defaults") or []:
        for group, option in entry.items() if isinstance(entry, dict) else []:
            if group.split()[-1].strip("/") == "hydra/sweeper":
                check_sweeper(str(option))
    params = ((sweep.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    try:
        check_overrides([f"{key}={value}" for key, value in params.items()])
    except ConfigError as e:
        raise ConfigError(f"configs/sweep/{name}.yaml, hydra.sweeper.params: {e}") from None


class _HydraRun:
    """Tracks whether our task function started, to tell Hydra's config errors from ours."""

    task_started = False


def _run_training(cfg: DictConfig) -> Optional[float]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ppo_trainer.config import validate_static
    from ppo_trainer.plan import describe_plan, dtype_summary, environment_problems

    _HydraRun.task_started = True
    try:
        cfg = validate_static(cfg)
        hydra_cfg = HydraConfig.get()
        user_set_output = any(o.lstrip("+").startswith("trainer.output_dir=") for o in hydra_cfg.overrides.task)
        if hydra_cfg.mode == RunMode.MULTIRUN and not user_set_output:
            # Each sweep job writes (and resumes) in its own job directory.
            cfg.trainer.output_dir = hydra_cfg.runtime.output_dir
        problems = environment_problems(cfg)
        if cfg.trainer.dry_run:
            plan = describe_plan(cfg, problems)
            print(plan)
            if hydra_cfg.mode == RunMode.MULTIRUN:
                # A sweep's folder exists anyway (multirun.yaml): record each job's plan in it.
                Path(cfg.trainer.output_dir, "plan.txt").write_text(plan + "\n")
            else:
                _remove_if_empty(Path(hydra_cfg.runtime.output_dir))
            return None
        if problems:
            raise ConfigError(problems[0])
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # Each job's own overrides, for ppo-sweep-report (hydra.output_subdir is null in
            # ppo.yaml, so Hydra keeps no .hydra/overrides.yaml).
            job_dir = Path(cfg.trainer.output_dir)
            job_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), job_dir / "overrides.yaml")
        from ppo_trainer.tracking import engine_output_to_file
        from ppo_trainer.trainer import run_training

        if cfg.trainer.verbose:
            _verbose_engine_logs()
        with engine_output_to_file(Path(cfg.trainer.output_dir) / "engine.log", cfg.trainer.verbose):
            log.info("dtypes: %s", dtype_summary(cfg))
            return run_training(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one finishes the step and saves)
        print(f"ppo-train: interrupted; {last_checkpoint(Path(cfg.trainer.output_dir))}", file=sys.stderr)
        sys.exit(130)
    except ConfigError as e:
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        print(f"ppo-train: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except _input_errors() as e:
        print(f"ppo-train: input error: {e}", file=sys.stderr)
        sys.exit(2)
    except _run_errors() as e:
        print(f"ppo-train: stopped: {e}", file=sys.stderr)
        sys.exit(1)


def last_checkpoint(output_dir: Path) -> str:
    """Which checkpoint a rerun of the same command continues from, in words."""
    from ppo_trainer.checkpoint import checkpoints_dir, complete_steps

    steps = complete_steps(output_dir)
    if not steps:
        return "no checkpoint was written yet: a rerun starts over"
    return f"the last complete checkpoint is {checkpoints_dir(output_dir) / f'global_step_{steps[-1]}'}: rerun to continue"


def _loaded_errors(*names: tuple[str, str]) -> tuple[type[BaseException], ...]:
    """The exception classes (module, name) of modules already imported: the run imports them
    lazily, and an error class of a module that never loaded cannot have been raised."""
    modules = [(sys.modules.get(module), name) for module, name in names]
    return tuple(getattr(mod, name) for mod, name in modules if mod is not None and hasattr(mod, name))


def _run_errors() -> tuple[type[BaseException], ...]:
    """Failures during training that carry their own full explanation (row, role, rank,
    checkpoint): shown as one line, without a traceback of the driver."""
    return _loaded_errors(("ppo_trainer.rewards.loader", "RewardError"), ("ppo_trainer.trainer", "NonFiniteError"),
                          ("ppo_trainer.workers.ray_backend", "WorkerError"))


def _remove_if_empty(folder: Path) -> None:
    """A dry run leaves nothing behind: drop the run folder Hydra created (and its parents below
    the working directory) while they are empty."""
    cwd = Path.cwd().resolve()
    folder = folder.resolve()
    while folder != cwd and cwd in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors of user input (data rows, files, model paths) raised by the lazily imported modules."""
    return (FileNotFoundError, *_loaded_errors(("ppo_trainer.data", "DataError"),
                                               ("ppo_trainer.models.loading", "ModelPathError"),
                                               ("ppo_trainer.checkpoint", "CheckpointError")))


def train_main(argv: Optional[list[str]] = None) -> None:
    """Entry point of `ppo-train`: Hydra app over configs/ppo.yaml, with early config checks."""
    argv = sys.argv[1:] if argv is None else argv
    _quiet_third_party_logs()
    register_configs()
    flags, overrides = split_overrides(argv)
    overrides = normalize_overrides(overrides)
    if not any(f in ("--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc") for f in flags):
        try:
            check_overrides(overrides)
        except ConfigError as e:
            print(f"ppo-train: config error: {e}", file=sys.stderr)
            sys.exit(2)

    import hydra

    task = hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(_run_training)
    sys.argv = [sys.argv[0], *flags, *overrides]
    _HydraRun.task_started = False
    try:
        task()
    except SystemExit as e:
        if e.code == 1 and not _HydraRun.task_started:
            sys.exit(2)  # Hydra rejected the command line or the composition: a config error
        raise


def compose(overrides: list[str]) -> DictConfig:
    """Compose and statically validate a config without Hydra's run machinery (tests, ppo-eval)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ppo_trainer.config import validate_static

    register_configs()
    overrides = normalize_overrides(overrides)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    return validate_static(cfg)


def eval_main(argv: Optional[list[str]] = None) -> None:
    """Entry point of `ppo-eval`: greedy accuracy of a model on a dataset split."""
    argv = sys.argv[1:] if argv is None else argv
    _quiet_third_party_logs()
    if any(a in ("-h", "--help") for a in argv):
        print("usage: ppo-eval [key=value ...]   e.g. ppo-eval model.path=embedded:smollm2-135m-instruct "
              "data.source=files data.val_files=[test.jsonl] eval.limit=64")
        return
    try:
        cfg = compose([a for a in argv if not a.startswith("-")])
        from ppo_trainer.evaluate import run_eval

        run_eval(cfg)
    except ConfigError as e:
        print(f"ppo-eval: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except _input_errors() as e:
        print(f"ppo-eval: input error: {e}", file=sys.stderr)
        sys.exit(2)


# Log levels of the engines, applied unless the environment sets them: (quiet, trainer.verbose=true).
_ENGINE_LOG_LEVELS = {"TRANSFORMERS_VERBOSITY": ("error", "info"), "VLLM_LOGGING_LEVEL": ("WARNING", "INFO")}
_defaulted: set[str] = set()


def _verbose_engine_logs() -> None:
    """trainer.verbose=true: the engines log at their info level (read when they are imported)."""
    for var in _defaulted:
        os.environ[var] = _ENGINE_LOG_LEVELS[var][1]


def _quiet_third_party_logs() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for var, (quiet, _) in _ENGINE_LOG_LEVELS.items():  # transformers: no per-load reports or progress bars
        if var not in os.environ:
            os.environ[var] = quiet
            _defaulted.add(var)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "urllib3", "filelock", "datasets", "transformers", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)
