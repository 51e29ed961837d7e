"""`ppo-train` (a Hydra app) and `ppo-eval`. Exit codes: 0 success, 1 a runtime failure, 2 a config
or input error (Hydra exits 1 on a bad override: overrides are checked before Hydra runs, and an
exit before our task starts counts as a config error). torch, ray, vllm load inside the run.

Secrets never reach Hydra: it prints the command line's overrides (launcher and error lines) and
saves them (multirun.yaml), so `reward.remote.token=...` moves into $PPO_REWARD_TOKEN before Hydra
reads the command line, credentials in a URL are refused, and `MaskSecrets` masks the copies of
the config Hydra writes (docs/rewards.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, MutableMapping, NoReturn, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ppo_trainer.config.composition import check_grid_sweep, compose
from ppo_trainer.config.overrides import check_overrides, normalize_overrides
from ppo_trainer.config.schema import CONFIG_DIR, CONFIG_NAME, ConfigError
from ppo_trainer.config.secrets import has_credentials, mask_argument, mask_secrets
from ppo_trainer.config.validation import url_credentials_error, validate_static
from ppo_trainer.console import engine_output_to_file, random_model_note, set_engine_log_levels, shown_path
from ppo_trainer.errors import InputError, RunError
from ppo_trainer.rewards.remote import TOKEN_ENV
from ppo_trainer.run.folder import absolute_output_dir, exclusive, output_dir_problem
from ppo_trainer.tracking import flatten

if TYPE_CHECKING:
    from ppo_trainer.rewards.scoring import Scorer

log = logging.getLogger("ppo_trainer")


_task_started = False  # tells Hydra's exits (a config error) from our task's
_typed_command: list[str] = []  # the command line as typed, the token moved out and secrets masked: command.txt
_failure_line: Optional[str] = None  # the last line after the traceback of an unexpected exception


def check_search_direction(search: object, objective: str) -> None:
    """An Optuna search and the runs it starts must agree on which objective value is best: the
    runs report (and `ppo-sweep-report` ranks) by `trainer.objective_direction`."""
    if search != objective:
        raise ConfigError(f"hydra.sweeper.direction={search} but trainer.objective_direction={objective}: the "
                          "search would steer towards what the runs call worst; set both to the same direction")


def _run_training(cfg: DictConfig) -> Optional[float]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ppo_trainer.plan.dry_run import describe_plan, dtype_summary, environment_problems, reward_summary

    global _task_started
    _task_started = True
    try:
        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        try:
            cfg = validate_static(cfg)
        except ConfigError as e:
            if multirun and "optuna" in str(hydra_cfg.sweeper.get("_target_", "")):
                # the search goes on (a grid sweep was checked before job 0). Not NaN: the Optuna
                # sweeper plugin (1.2, Optuna 2.x) fails the whole search on a NaN trial value
                worst = float("-inf") if hydra_cfg.sweeper.get("direction") == "maximize" else float("inf")
                log.error("ppo-train: trial %s not run, its values are invalid (scored %s): %s", hydra_cfg.job.num,
                          worst, e)
                return worst
            raise
        if multirun and "optuna" in str(hydra_cfg.sweeper.get("_target_", "")):
            check_search_direction(hydra_cfg.sweeper.get("direction"), cfg.trainer.objective_direction)
        unusable = output_dir_problem(cfg.trainer.output_dir)
        if unusable:
            raise ConfigError(unusable)
        user_set_output = any(o.lstrip("+").startswith("trainer.output_dir=") for o in hydra_cfg.overrides.task)
        if multirun:  # each sweep job writes (and resumes) in its own folder: the job's, or <output_dir>/<job number>
            cfg.trainer.output_dir = (str(Path(cfg.trainer.output_dir) / str(hydra_cfg.job.num)) if user_set_output
                                      else hydra_cfg.runtime.output_dir)
        output_dir = absolute_output_dir(cfg)
        problems = environment_problems(cfg)
        if cfg.trainer.dry_run:
            plan = describe_plan(cfg, problems)
            print(plan)
            if multirun:  # a sweep's job folders exist anyway (multirun.yaml): record each job's plan in its own
                Path(hydra_cfg.runtime.output_dir, "plan.txt").write_text(plan + "\n")
            else:
                _remove_if_empty(Path(hydra_cfg.runtime.output_dir))
                if cfg.devices.backend == "ray" and cfg.devices.ray.address:
                    from ppo_trainer.workers.cluster.check import run_check

                    run_check(cfg)  # the cluster this run would join, checked (docs/cluster.md)
            return None
        if problems:
            raise ConfigError(problems[0])
        with exclusive(output_dir):  # before anything is written into the folder
            if multirun:  # for ppo-sweep-report: hydra.output_subdir=null keeps no .hydra/overrides.yaml
                OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), output_dir / "overrides.yaml")
            with engine_output_to_file(output_dir / "engine.log", cfg.trainer.verbose):
                from ppo_trainer.trainer import run_training  # after the engines' log levels are set

                start = [f"dtypes: {dtype_summary(cfg)}"]
                if cfg.reward.remote.url:  # the score comes from elsewhere: say where (credentials masked)
                    start.append(f"reward: {reward_summary(cfg)}")
                start += [note for note in [random_model_note(cfg)] if note is not None]
                return run_training(cfg, _typed_command, start)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one finishes the step and saves)
        from ppo_trainer.run.checkpoint import last_checkpoint_line

        print(f"ppo-train: interrupted; {last_checkpoint_line(Path(cfg.trainer.output_dir))}", file=sys.stderr)
        sys.exit(130)
    except ConfigError as e:
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        _exit("ppo-train: config error", e, 2)
    except (FileNotFoundError, InputError) as e:
        _exit("ppo-train: input error", e, 2)
    except RunError as e:
        _exit("ppo-train: stopped", e, e.exit_code)
    except Exception as e:  # a failure nothing above foresaw: Hydra prints its traceback, train_main then this
        from ppo_trainer.run.checkpoint import last_checkpoint_line

        global _failure_line
        _failure_line = (f"ppo-train: failed with an unexpected {type(e).__name__} (traceback above): "
                         f"{last_checkpoint_line(Path(cfg.trainer.output_dir))}")
        raise


def _exit(what: str, error: BaseException, code: int) -> NoReturn:
    print(f"{what}: {error}", file=sys.stderr)
    sys.exit(code)


def _remove_if_empty(folder: Path) -> None:
    """Drop the empty run folder Hydra created, and its empty parents below the working directory."""
    cwd = Path.cwd().resolve()
    folder = folder.resolve()
    while folder != cwd and cwd in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def train_main(argv: Optional[list[str]] = None) -> None:
    """Entry point of `ppo-train`: Hydra app over configs/ppo.yaml, with early config checks."""
    import hydra
    from hydra._internal.utils import get_args_parser

    argv = sys.argv[1:] if argv is None else argv
    overrides = get_args_parser().parse_intermixed_args(argv).overrides  # as Hydra's own parser reads them
    flags = [arg for arg in argv if arg not in overrides]  # Hydra's flags, with their values
    # --info logs through a stdout handler Hydra adds to the root logger: ours would repeat each line
    _quiet_third_party_logs(console=not any(f == "--info" or f.startswith("--info=") for f in flags))
    try:  # first: Hydra's --help and --cfg print the overrides' values too
        overrides = move_token_to_environment(overrides, os.environ)
        refuse_url_credentials(overrides)
    except ConfigError as e:
        _exit("ppo-train: config error", e, 2)
    _typed_command[:] = ["ppo-train", *(mask_argument(arg) for arg in argv if arg in flags or arg in overrides)]
    overrides = normalize_overrides(overrides)
    if not any(f in ("--help", "-h", "--hydra-help", "--shell-completion", "-sc") for f in flags):
        try:
            check_overrides(overrides)
            if any(f in ("--multirun", "-m") for f in flags):
                check_grid_sweep(overrides)
            elif not any(f in ("--cfg", "-c", "--info") or f.startswith(("--cfg=", "--info=")) for f in flags):
                check_output_dir(overrides)  # Hydra makes trainer.output_dir (hydra.run.dir) before our task
        except ConfigError as e:
            _exit("ppo-train: config error", e, 2)

    task = hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(_run_training)
    sys.argv = [sys.argv[0], *overrides, *flags]  # overrides first: `--info` takes an optional value
    global _task_started, _failure_line
    _task_started, _failure_line = False, None
    try:
        task()
    except SystemExit as e:
        if e.code == 1 and not _task_started:
            sys.exit(2)  # Hydra rejected the command line or the composition: a config error
        if _failure_line is not None:  # after the traceback Hydra printed
            print(_failure_line, file=sys.stderr)
        raise
    except Exception:  # HYDRA_FULL_ERROR=1: Hydra raises it on
        if _failure_line is None:
            raise
        traceback.print_exc()
        print(_failure_line, file=sys.stderr)
        sys.exit(1)


_TOKEN_OVERRIDE = re.compile(r"^\+{0,2}reward\.remote\.token=(.*)$", re.DOTALL)
_URL_OVERRIDE = re.compile(r"^\+{0,2}reward\.remote\.url=(.*)$", re.DOTALL)


def move_token_to_environment(overrides: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """`overrides` less `reward.remote.token=VALUE`, whose value goes to $PPO_REWARD_TOKEN instead,
    where the reward client reads it (`rewards.remote.bearer_token`). A value Hydra's grammar cannot
    read (base64's `=` and `/`) is taken whole, a quoted one without its quotes; an interpolation
    (`${oc.env:...}`), null or '' stays an override: it holds no secret. ConfigError for a sweep
    over several tokens, without echoing them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    kept = []
    for override in overrides:
        match = _TOKEN_OVERRIDE.match(override)
        if match is None:
            kept.append(override)
            continue
        try:
            parsed = OverridesParser.create().parse_override(override)
        except HydraException:
            parsed = None  # Hydra never sees it: the raw text is the token
        if parsed is not None and parsed.is_sweep_override():
            raise ConfigError("reward.remote.token is swept over several values, but a run sends one token: give one, "
                              f"or better set ${TOKEN_ENV}, and sweep other keys")
        value = parsed.value() if parsed is not None else match.group(1)
        if value is None or value == "" or (isinstance(value, str) and "${" in value):
            kept.append(override)
        else:
            environ[TOKEN_ENV] = value if isinstance(value, str) else match.group(1)
    return kept


def refuse_url_credentials(overrides: list[str]) -> None:
    """ConfigError (the URL masked) for `reward.remote.url=` credentials (`user:password@`) on the
    command line, before Hydra prints them; validation refuses those of a config file."""
    for override in overrides:
        match = _URL_OVERRIDE.match(override)
        urls = [url.strip("'\" ") for url in match.group(1).split(",")] if match else []
        for url in urls:
            if has_credentials(url):
                raise url_credentials_error(url)


def check_output_dir(overrides: list[str]) -> None:
    """ConfigError when the composed `trainer.output_dir` is a file or lies under one: one line
    instead of the traceback of Hydra making the run's folder there."""
    unusable = output_dir_problem(compose(overrides).trainer.output_dir)
    if unusable:
        raise ConfigError(unusable)


class MaskSecrets(Callback):
    """Hydra's own copies of the config (a sweep's multirun.yaml; .hydra/config.yaml of a job when
    hydra.output_subdir is set) masked as ours are (`config.secrets.mask_secrets`): a token written in a
    config file stays in that file. Named in configs/ppo.yaml under hydra.callbacks."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweeper saves this object as multirun.yaml; each job composes its own config again.
        Leaf by leaf: the typed nodes refuse a plain dict (Hydra turns a callback's error into a warning)."""
        task = _task(config)
        before = flatten(task)
        with read_write(config), open_dict(config):
            for key, value in flatten(mask_secrets(task)).items():
                if value != before[key]:
                    OmegaConf.update(config, key, value, merge=False)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Hydra saved the job's config (unmasked) just before this call."""
        subdir = config.hydra.output_subdir
        saved = Path(config.hydra.runtime.output_dir, subdir, "config.yaml") if subdir else None
        if saved is not None and saved.is_file():
            OmegaConf.save(OmegaConf.create(mask_secrets(_task(config))), saved)


class SweepEnd(Callback):
    """A sweep ends naming its folder and the command that compares its jobs (`ppo-sweep-report`).
    Named in configs/ppo.yaml under hydra.callbacks."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = shown_path(Path(config.hydra.sweep.dir))
        print(f"ppo-train: the sweep's runs are in {folder}/<job number>; compare them with: ppo-sweep-report "
              f"{shlex.quote(folder)}", flush=True)


def _task(config: DictConfig) -> dict[str, Any]:
    """The config less Hydra's part, unresolved, as plain containers."""
    return {key: OmegaConf.to_container(config[key], resolve=False) for key in config if key != "hydra"}


def eval_main(argv: Optional[list[str]] = None) -> None:
    _quiet_third_party_logs()
    parser = argparse.ArgumentParser(
        prog="ppo-eval",
        description="Accuracy of one or more models on a dataset split, scored by the reward function: greedy "
                    "decoding by default; eval.n=N samples N responses per prompt at eval.temperature (unset: the "
                    "sampler's) and reports mean@N and pass@N.",
        epilog="e.g. ppo-eval model.path=embedded:smollm2-135m-instruct data.source=files "
               "data.val_files=[test.jsonl] eval.limit=64. model.path: a model folder or name, a checkpoint's "
               "actor folder, a global_step_N folder, checkpoints/latest or checkpoints/best, or a run's output "
               "folder (a checkpoint is evaluated with its run's config, but runs a reward.fn of its own only when "
               "the command line names it, as the run's summary does); model.path=[A,B] compares several on the "
               "same problems. Responses: a checkpoint's into <run>/eval/global_step_N.jsonl, any other model's "
               "into eval.jsonl here; eval.output_file=PATH wins")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for ppo-train")
    overrides = parser.parse_args(argv).overrides  # argv None: sys.argv[1:]; an unknown flag: usage and exit 2
    for arg in overrides:
        if "=" not in arg:
            parser.error(f"'{arg}' is not a key=value override")
    try:
        run_eval(overrides)
    except ConfigError as e:
        _exit("ppo-eval: config error", e, 2)
    except (FileNotFoundError, InputError) as e:
        _exit("ppo-eval: input error", e, 2)


def rm_main(argv: Optional[list[str]] = None) -> None:
    """Entry point of `ppo-train-rm` (ppo_trainer/rm/, configs/rm.yaml): a reward model from preference pairs."""
    _quiet_third_party_logs()
    parser = argparse.ArgumentParser(
        prog="ppo-train-rm", description="Train a reward model (a one-label sequence classifier) on preference pairs "
                                         "with the Bradley-Terry loss; docs/reward-models.md.",
        epilog="e.g. ppo-train-rm model=tiny data.train_files=[pairs.jsonl] data.val_files=[val.jsonl] "
               "trainer.total_steps=4 trainer.output_dir=runs/rm")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (configs/rm.yaml)")
    overrides = parser.parse_args(argv).overrides
    from ppo_trainer.rm.train import compose_rm, run_rm

    try:
        cfg = compose_rm(overrides)
        unusable = output_dir_problem(cfg.trainer.output_dir)
        if unusable:
            raise ConfigError(unusable)
        run_rm(cfg, ["ppo-train-rm", *(mask_argument(arg) for arg in overrides)])
    except ConfigError as e:
        _exit("ppo-train-rm: config error", e, 2)
    except (FileNotFoundError, InputError) as e:
        _exit("ppo-train-rm: input error", e, 2)
    except RunError as e:
        _exit("ppo-train-rm: stopped", e, e.exit_code)


# --- ppo-eval


def resolve_target(path: str, scratch: Path) -> tuple[Path, Optional[Path], Optional[int]]:
    """(model folder, the run's config file or None, checkpoint step or None) of a ppo-eval model.path:
    a model, or a checkpoint (`run.checkpoint.checkpoint_target`); a LoRA adapter is merged into its
    base (the run's model.path, else the adapter's own base) under `scratch`."""
    from ppo_trainer.config.composition import load_saved
    from ppo_trainer.models.export import merge_adapter
    from ppo_trainer.models.loading import ModelPathError, resolve_model_path
    from ppo_trainer.run.checkpoint import checkpoint_target

    target = checkpoint_target(path)
    model, run_config, step = target if target is not None else (Path(path).expanduser(), None, None)
    if (model / "adapter_config.json").is_file():
        base = (load_saved(run_config).model.path if run_config is not None
                else json.loads((model / "adapter_config.json").read_text()).get("base_model_name_or_path"))
        log.info("eval: applying the LoRA adapter %s to its base %s", model, base)
        try:
            base_dir = resolve_model_path(base)
        except ModelPathError as e:
            if run_config is None:
                raise
            raise ModelPathError(f"{e}; the adapter's base model.path={base} came from the run's config ({run_config}): "
                                 "put the base model there, or evaluate the run's merged export (global_step_N/"
                                 "actor_merged) where it has one") from None
        return merge_adapter(model, base_dir, scratch), run_config, step
    if target is None:
        return resolve_model_path(path), None, None
    if not (model / "config.json").is_file():
        raise ModelPathError(f"model.path='{path}': {model} holds neither a model (config.json) nor a LoRA adapter")
    return model, run_config, step


def model_paths(overrides: list[str]) -> tuple[list[str], list[str]]:
    """The `model.path` values of the overrides (one, or a list `[A,B]`) and the other overrides."""
    paths: list[str] = []
    for override in (o for o in overrides if o.partition("=")[0] == "model.path"):
        value = OverridesParser.create().parse_overrides([override])[0].value()
        paths = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return paths, [o for o in overrides if o.partition("=")[0] != "model.path"]


def eval_output_file(output_file: Optional[str], run_config: Optional[Path], step: Optional[int], index: int,
                     count: int) -> Path:
    """Where ppo-eval writes one model's responses: `output_file` (eval.output_file) when given; a
    run's checkpoint (`run_config`, the checkpoint's state/config.yaml) into the run's eval/ folder as
    global_step_N.jsonl, never inside checkpoints/; any other model eval.jsonl in the current folder.
    Among several models a shared name is numbered (eval.0.jsonl, eval.1.jsonl)."""
    from ppo_trainer.run.folder import EVAL_DIR

    if output_file is None and run_config is not None:
        return run_config.parents[3] / EVAL_DIR / f"global_step_{step}.jsonl"  # <run>/checkpoints/global_step_N/state
    file = Path(output_file or "eval.jsonl")
    return file if count == 1 else file.with_suffix(f".{index}{file.suffix}")


def validation_scorer(cfg: Any) -> Scorer:
    """ppo-eval's scorer: eval.reward_fn, else reward.fn (a run trained on a reward model or server
    alone is evaluated by the function its command line names)."""
    from ppo_trainer.rewards.scoring import build_scorer

    key = "eval.reward_fn" if cfg.eval.reward_fn else "reward.fn"
    scorer = build_scorer(OmegaConf.merge(cfg.reward, {"fn": OmegaConf.select(cfg, key)}), key)
    if scorer is None:
        raise ConfigError("ppo-eval scores with a reward function, and neither eval.reward_fn nor reward.fn names one "
                          "(the run was trained on a reward model or server): pass eval.reward_fn=module:function")
    return scorer


def run_eval(overrides: list[str]) -> list[dict[str, Any]]:
    """`ppo-eval`: every `model.path` of `overrides` on the same problems, responses written where
    `eval_output_file` says, the engines' output into engine.log beside the first model's. A run's
    checkpoint uses the run's config under the overrides (`eval_config`) and its sampler; any other
    model vLLM if installed, else HF. eval.n samples per prompt seeded as the run's validation of the checkpoint's step.
    Each result is `evaluate_records`' plus `model`, `step`, `temperature` (None: greedy) and `seconds`."""
    import dataclasses
    import gc
    import tempfile
    import time
    from contextlib import closing

    from ppo_trainer.agents import load_multi_turn
    from ppo_trainer.config.composition import compose
    from ppo_trainer.config.trust import eval_config
    from ppo_trainer.data import load_prompts
    from ppo_trainer.evaluate import (
        eval_temperature,
        evaluate_records,
        first_per_source,
        format_results,
        validation_seed,
    )
    from ppo_trainer.models.loading import load_tokenizer
    from ppo_trainer.rewards.loader import answer_check
    from ppo_trainer.rewards.math import EXTRACTORS
    from ppo_trainer.rollout import build_sampler
    from ppo_trainer.rollout import vllm as vllm_rollout
    from ppo_trainer.workers.process_tuning import bound_cpu_kernel_caches

    paths, rest = model_paths(overrides)
    composed = compose(rest)
    paths = paths or [composed.model.path]  # the model of an experiment, or the default
    with tempfile.TemporaryDirectory(prefix="ppo-eval-") as scratch:
        targets = [resolve_target(p, Path(scratch)) for p in paths]
        run_config = next((config for _, config, _ in targets if config is not None), None)
        cfg = eval_config(composed, rest, run_config)
        if run_config is not None:
            log.info("eval: data, prompts, reward and sampler of the run (%s)", run_config)
        name = cfg.sampler.name if run_config is not None else "hf" if vllm_rollout.check_vllm_available() else "vllm"
        sampler_cfg = dataclasses.replace(OmegaConf.to_object(cfg.sampler), name=name, n=1,
                                          max_new_tokens=cfg.eval.max_new_tokens)
        files = [eval_output_file(cfg.eval.output_file, config, step, i, len(targets))
                 for i, (_, config, step) in enumerate(targets)]
        n = cfg.eval.n
        temperature = eval_temperature(cfg.eval.temperature, n, cfg.sampler.temperature)
        sampling = {"greedy": True} if temperature is None else {"temperature": temperature}
        decoding = "greedy decoding" if temperature is None else f"{n} samples per prompt at temperature {temperature}"
        results = []
        bound_cpu_kernel_caches()  # as a trainer's workers do: greedy batches shrink step by step (new shapes)
        # the engines' start-up chatter and per-call warnings go next to the responses, as in ppo-train
        # the reward workers too (they start here, and write where the driver writes)
        with engine_output_to_file(files[0].parent / "engine.log", cfg.trainer.verbose), \
                closing(validation_scorer(cfg)) as scorer:
            for path, (model_dir, _, step), output_file in zip(paths, targets, files):
                tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
                tools = load_multi_turn(cfg.sampler.multi_turn, tokenizer, dict(cfg.data.chat_template_kwargs))[1]
                loaded = load_prompts(cfg.data, tokenizer, "val", check_answer=answer_check(cfg, "val"), tools=tools)
                records = first_per_source(loaded, cfg.eval.limit)
                log.info("eval: %s with %s", decoding, "vLLM" if name == "vllm" else "Hugging Face generate")
                sampler = build_sampler(sampler_cfg, model_dir, dtype=cfg.model.dtype,
                                        max_prompt_length=max(len(r.prompt_ids) for r in records),
                                        trust_remote_code=cfg.model.trust_remote_code,
                                        chat_template_kwargs=dict(cfg.data.chat_template_kwargs))
                start = time.perf_counter()
                try:
                    result = evaluate_records(lambda batch, seed: sampler.generate(batch, n, seed=seed, **sampling),
                                              records, scorer, pad_id=tokenizer.pad_token_id, n=n,
                                              seed=validation_seed(cfg.trainer.seed, step or 0),
                                              batch_size=cfg.eval.batch_size, extract=EXTRACTORS[cfg.reward.mode],
                                              output_file=output_file)
                finally:
                    sampler = None  # dropped (the lambda above holds the name, not the engine)
                    gc.collect()  # the next model's engine gets the memory
                results.append({"model": path, "step": step, **result, "temperature": temperature,
                                "seconds": time.perf_counter() - start})
    print(format_results(results, cfg.reward.mode))
    return results


def _quiet_third_party_logs(console: bool = True) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    set_engine_log_levels(verbose=False)  # transformers: no per-load reports or progress bars
    if console:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "urllib3", "filelock", "datasets", "transformers", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    train_main()
