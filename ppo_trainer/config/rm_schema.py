"""The schema of `ppo-train-rm` (configs/rm.yaml): a reward model trained on preference pairs. `model`
and `devices` take ppo-train's group options (configs/model, configs/devices); `data` and `trainer`
are its own. Batch sizes count pairs (a pair is two sequences: chosen and rejected), lengths count
tokens, `trainer.total_steps` counts optimizer steps. Rules and comments as in schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union, get_args, get_origin

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ppo_trainer.config.schema import (
    DTYPES,
    LOGGERS,
    ROW_KEY,
    ConfigError,
    DevicesConfig,
    LoraConfig,
    OptimConfig,
    at_least,
    choice,
    matching,
    schema_rules,
)


@dataclass
class RMModelConfig:  # the reward model: a one-label sequence classifier on a causal LM's backbone
    # the starting weights: a causal LM (its LM head is left out, a score head starts at random) or a
    # sequence classifier with one label; a folder, a hub name, embedded:NAME or random:tiny
    path: str = "embedded:smollm2-135m-instruct"
    dtype: str = field(default="auto", metadata=choice(*DTYPES))  # compute dtype; auto: bfloat16 where native
    attn_implementation: str = field(
        default="sdpa", metadata=choice("sdpa", "eager", "flash_attention_2", "flash_attention_3"))
    trust_remote_code: bool = False  # run the model's own code from its folder or hub repository
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more time)
    cpu_offload: bool = False  # FSDP2 parameter and optimizer offload to host memory
    # LoRA adapters on the backbone (the score head trained in full); the export is merged
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class RMDataConfig:  # preference pairs: files or a hub dataset, each row a prompt, a chosen and a rejected response
    source: str = "files"  # files | a hub dataset name (e.g. Anthropic/hh-rlhf)
    hub_config: Optional[str] = None  # the hub dataset's config
    train_split: str = "train"  # the split of a hub dataset to train on
    val_split: str = "test"  # the split of a hub dataset to validate on
    train_files: list[str] = field(default_factory=list)  # jsonl or parquet
    val_files: list[str] = field(default_factory=list)  # held-out pairs, as train_files
    # the row's prompt (text or chat messages); None: "prompt" where the row has one, else the prompt is
    # inside chosen and rejected (HH-RLHF's text, or full conversations)
    prompt_key: Optional[str] = field(default=None, metadata=ROW_KEY)
    chosen_key: str = field(default="chosen", metadata=matching(".+", "a non-empty key"))  # the preferred response
    rejected_key: str = field(default="rejected", metadata=matching(".+", "a non-empty key"))  # the other one
    # a number the chosen score must beat the rejected one by (Llama 2's margin); None: no margin
    margin_key: Optional[str] = field(default=None, metadata=ROW_KEY)
    # a row's source; rows without it: the dataset or file name
    source_key: str = field(default="data_source", metadata=matching(".+", "a non-empty key"))
    train_batch_size: int = field(default=16, metadata=at_least(1))  # pairs per optimizer step
    max_length: int = field(default=512, metadata=at_least(2))  # the longest sequence (prompt and response), in tokens
    # pairs with a side over max_length: dropped (counted per source), or an error
    overlong_pairs: str = field(default="drop", metadata=choice("drop", "error"))
    # a malformed row (identical chosen and rejected included): an error, or skipped (with a count)
    bad_rows: str = field(default="error", metadata=choice("error", "skip"))
    shuffle: bool = True  # training pairs in a new order every epoch


@dataclass
class RMTrainerConfig:  # the run: steps, validation, checkpoints, resume, logging
    experiment_name: str = field(default="rm", metadata=matching(
        r"[\w.-]+", "letters, digits, '.', '_' and '-' only", why="it names folders: outputs/<name>"))
    output_dir: str = "outputs/${trainer.experiment_name}"  # the run's folder; fixed, so rerunning resumes
    total_steps: int = field(default=100, metadata=at_least(1))  # optimizer steps, each of data.train_batch_size pairs
    seed: int = 0  # seeds the score head's initial weights and the shuffling
    # tokens of one forward/backward (a pair's two sequences, padded to the longer, count together)
    micro_batch_tokens: int = field(default=4096, metadata=at_least(2))
    val_every: int = field(default=10, metadata=at_least(0))  # validation every N steps; 0: before and after only
    save_every: int = field(default=10, metadata=at_least(0))  # a checkpoint every N steps; 0 saves only at the end
    keep_last: int = field(default=2, metadata=at_least(1))  # checkpoints kept (and the best); older ones removed
    resume: str = "auto"  # auto | never (the previous run is moved aside) | a checkpoint or run folder
    # refused resume changes accepted knowingly (ppo_trainer/rm/train.py REFUSED; "data": other training pairs)
    resume_allow: list[str] = field(default_factory=list)
    # end this invocation early (total_steps unchanged); None: run to total_steps
    stop_after_steps: Optional[int] = field(default=None, metadata=at_least(1, null="to run to trainer.total_steps"))
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"], metadata=choice(*LOGGERS))
    # the metric checkpoints/best follows (the highest): held-out pairwise accuracy, pooled or of one data_source
    objective: str = field(default="val/pairwise_accuracy", metadata=matching(
        r"val/(.+/)?pairwise_accuracy", "val/pairwise_accuracy or val/<data_source>/pairwise_accuracy"))
    verbose: bool = False  # show the engines' output on the console (else it goes to <output_dir>/engine.log)


@dataclass
class RMConfig:
    model: RMModelConfig = field(default_factory=RMModelConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)


# rm.yaml lists `rm_schema` first in its defaults: every group option merges into it.
ConfigStore.instance().store(name="rm_schema", node=RMConfig)
RM_CONFIG_NAME = "rm"


def validate_rm(cfg: DictConfig) -> DictConfig:
    """The typed, resolved config of `ppo-train-rm`: types, each field's rule, and the rules that span
    keys; no file or device access (ConfigError, exit 2, before anything loads)."""
    from ppo_trainer.config.validation import field_problem

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RMConfig), cfg)
        OmegaConf.resolve(cfg)
    except ConfigKeyError as e:  # a key the schema lacks, e.g. added with `+data.key`
        raise ConfigError(f"unknown config key '{e.full_key}' (ppo-train-rm's keys: ppo_trainer/config/rm_schema.py; "
                          "docs/reward-models.md)") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid value for '{getattr(e, 'full_key', None) or '?'}': {str(e).splitlines()[0]}") from None
    for key, (rule, hint) in schema_rules(RMConfig).items():
        problem = field_problem(rule, OmegaConf.select(cfg, key), get_origin(hint) is Union and type(None) in get_args(hint))
        _require(problem is None, key, problem or "")
    d, dev = cfg.data, cfg.devices
    _require(dev.backend == "local", "devices.backend",
             "is ray, but ppo-train-rm trains in one process (FSDP2 on one device); set devices.backend=local "
             "(devices=cpu or devices=gpu)")
    for role in ("actor", "critic", "rollout", "reward_model"):
        _require(dev[role].num_devices == 1, f"devices.{role}.num_devices",
                 f"is {dev[role].num_devices}, but ppo-train-rm runs one process on one device; set it to 1")
    _require(d.source not in ("arithmetic", "digits"), "data.source",
             f"is {d.source}, a prompt generator of ppo-train; ppo-train-rm reads preference pairs: data.source=files "
             "with data.train_files, or a hub dataset name (scripts/make_arithmetic_pairs.py makes arithmetic pairs)")
    _require(d.chosen_key != d.rejected_key, "data.rejected_key", f"is data.chosen_key's ({d.chosen_key!r}) too")
    _require(len(set(d.train_files)) == len(d.train_files), "data.train_files", "names a file twice")
    _require(cfg.model.lora.rank == 0 or len(cfg.model.lora.target_modules) > 0, "model.lora.target_modules",
             f"must name at least one module with model.lora.rank={cfg.model.lora.rank}")
    _require(cfg.trainer.micro_batch_tokens >= 2 * d.max_length, "trainer.micro_batch_tokens",
             f"({cfg.trainer.micro_batch_tokens}) must hold one pair: >= 2 x data.max_length = {2 * d.max_length}")
    return cfg


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"'{key}' {message}")
