"""The schema (the defaults live here; configs/ says what differs), static validation and
composition. Batch sizes count prompts (x sampler.n sequences), lengths count tokens."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Optional, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ppo_trainer import metric_names
from ppo_trainer.core import choices


class ConfigError(ValueError):
    """A config problem the user must fix; the message is one line naming the key."""


@dataclass
class LoraConfig:
    rank: int = 0  # 0 = full fine-tuning
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class ModelConfig:  # the actor; the reference and, by default, the critic start from it
    path: str = "embedded:smollm2-135m-instruct"
    dtype: str = "auto"  # actor and rollout compute dtype; auto: bfloat16 where native, else float32
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    cpu_offload: bool = False  # FSDP2 parameter and optimizer offload to host memory
    logprob_chunk_tokens: int = 1024  # tokens per chunk when computing logprobs from logits
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticConfig:  # the value model: a full-parameter backbone plus a Linear(hidden, 1) head
    path: Optional[str] = None  # None: the actor's model.path
    dtype: str = "auto"  # as model.dtype
    gradient_checkpointing: bool = False
    cpu_offload: bool = False
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    grad_clip: float = 1.0
    value_clip: Optional[float] = 0.5  # None disables value clipping


@dataclass
class VllmConfig:  # sampler=vllm only
    tensor_parallel_size: int = 1  # only 1: an engine spanning several devices is not built (validate_static)
    gpu_memory_utilization: Optional[float] = None  # share of a GPU for vLLM's weights and KV cache; None: 0.5
    max_model_len: Optional[int] = None  # None: max_prompt_length + max_new_tokens
    enforce_eager: bool = False
    # the KV cache in GiB (vLLM's kv_cache_memory_bytes: no memory profiling); one of this and
    # gpu_memory_utilization. None: 1 GiB on a CPU, gpu_memory_utilization on a GPU
    kv_cache_gb: Optional[float] = None


@dataclass
class SamplerConfig:
    name: str = "hf"  # hf | vllm
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_new_tokens every time (benchmarks)
    generate_batch_size: int = 64  # sequences per HF generate call (bounds memory); hf only
    sync_bucket_mb: float = 128.0  # weight sync: MiB per bucket streamed from the actor to each rollout replica
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class GaeConfig:
    gamma: float = 1.0
    lam: float = 1.0  # lambda of the policy's advantages
    critic_lam: Optional[float] = None  # lambda of the critic's returns (VC-PPO); None: gae.lam
    lam_mode: str = "fixed"  # fixed | adaptive: per-sequence 1 - 1/(adaptive_alpha * length) (VAPO)
    adaptive_alpha: float = 0.05  # lam_mode=adaptive only
    kl_coef: float = 0.001  # KL penalty in the reward (when algorithm.use_kl_in_reward); 0 disables it
    kl_penalty: str = "k1"  # k1 | abs | k2 | k3
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_target: float = 6.0  # adaptive controller: target KL per sequence
    kl_horizon: int = 10000  # adaptive controller: horizon in sequences
    normalize_advantages: bool = True


@dataclass
class AlgorithmConfig:
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8  # prompts per mini-batch (x sampler.n sequences)
    ppo_micro_batch_tokens: int = 4096  # tokens of one forward/backward per device (a shared prompt counts once)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: Optional[float] = None  # c > 1 bounds the loss of negative advantages
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    entropy_coef: float = 0.0
    critic_warmup: int = 0  # PPO steps that update only the critic
    use_kl_loss: bool = False  # KL to the reference as a loss term (kl_loss_coef, kl_loss_type)
    use_kl_in_reward: Optional[bool] = None  # KL penalty in the reward (gae.kl_coef); None: not use_kl_loss
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    recompute_old_logprobs: bool = True  # False: use the sampler's logprobs as old logprobs
    rollout_correction: str = "none"  # none | tis | mis: weights pi_old / pi_rollout on the policy loss
    rollout_correction_cap: float = 2.0  # tis: token weights truncated at this value
    rollout_correction_low: float = 0.5  # mis: sequences whose geometric-mean ratio is outside
    rollout_correction_high: float = 2.0  # [low, high] get no policy loss
    shuffle_mini_batches: bool = True  # prompts (with their samples) in a new order every epoch


@dataclass
class DeviceRoleConfig:
    num_devices: int = 1


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local Ray bound to 127.0.0.1
    num_cpus: Optional[int] = None  # logical CPUs to declare when starting Ray
    dashboard: bool = False


@dataclass
class DevicesConfig:
    backend: str = "local"  # local | ray
    accelerator: str = "cpu"  # cpu | cuda | npu | auto
    colocate: bool = False  # all roles share the actor's devices
    devices_per_node: int = 8
    actor: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    critic: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    rollout: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    reward_model: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)  # with reward.model.path
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class ArithmeticConfig:  # the built-in generator of easy GSM8K-format word problems
    train_size: int = 20000
    val_size: int = 256
    max_operand: int = 20
    two_step_fraction: float = 0.3
    seed: int = 0


@dataclass
class DigitsConfig:  # data.source=digits: tasks for the tiny model (data/digits.py)
    task: str = "reverse"  # reverse (a digit string backwards) | sum (two digits, one-digit sum)
    min_length: int = 1  # reverse: training strings have min_length..length digits
    length: int = 3  # reverse: digits of the validation strings (held out from training)
    train_size: int = 3000  # training rows (one epoch of the prompt loader)
    val_size: int = 100  # reverse: distinct held-out strings; sum: validation is all 55 pairs
    seed: int = 0  # draws of the training rows


@dataclass
class DataConfig:
    source: str = "arithmetic"  # arithmetic | digits | files | a hub dataset name (openai/gsm8k)
    hub_config: Optional[str] = None  # e.g. "main" for openai/gsm8k
    train_split: str = "train"
    val_split: str = "test"
    # jsonl or parquet; a split with files reads them, whatever `source` says
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_weights: list[float] = field(default_factory=list)  # one per train file; []: by size
    # None: verl's layout ("prompt", "reward_model.ground_truth") for a file whose first row has a
    # reward_model, else "question", "answer". A dotted key is a path into nested objects.
    prompt_key: Optional[str] = None
    answer_key: Optional[str] = None
    source_key: str = "data_source"  # a row's source; rows without it: the generator, dataset or file name
    train_batch_size: int = 8  # prompts per PPO step
    max_prompt_length: int = 256  # tokens
    overlong_prompts: str = "drop"  # drop (counted per source) | error: prompts over max_prompt_length
    bad_rows: str = "error"  # error | skip (with a count)
    shuffle: bool = True
    # instruction and prompt_template shape string prompts; a message-list prompt is used as it is
    instruction: str = "Let's think step by step and output the final answer after \"####\"."
    prompt_template: str = "{question} {instruction}"  # user message, then the chat template
    use_chat_template: bool = True
    system_prompt: Optional[str] = None  # None: the template's default; a system turn in the data wins
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    digits: DigitsConfig = field(default_factory=DigitsConfig)


@dataclass
class RewardModelConfig:  # reward.model: a learned reward (docs/rewards.md)
    path: Optional[str] = None  # a sequence classifier with one label: a folder, a hub name, random:tiny-reward
    coef: float = 1.0  # its weight in the training score
    dtype: str = "auto"  # as model.dtype
    trust_remote_code: bool = False  # its own: model.trust_remote_code does not extend to it
    normalize: bool = False  # scores standardised by their running mean and std (kept in the checkpoint)
    clip: Optional[float] = None  # then clipped to [-clip, clip]


@dataclass
class RemoteRewardConfig:  # reward.remote: a reward server speaking OpenRLHF's protocol (docs/rewards.md)
    url: Optional[str] = None  # e.g. http://127.0.0.1:5000/get_reward
    coef: float = 1.0
    token: Optional[str] = None  # bearer token; e.g. ${oc.env:REWARD_TOKEN} (saved configs mask it)
    batch_size: int = 64  # rows per request
    concurrency: int = 4  # requests in flight
    retries: int = 3  # after a connection error or a 5xx answer, with doubling waits from 1 s
    normalize: bool = False
    clip: Optional[float] = None


@dataclass
class RewardConfig:  # docs/rewards.md
    # module:function or path/to/file.py:function; null: no function (a reward model or server scores)
    fn: Optional[str] = "ppo_trainer.rewards.math:score"
    batched: bool = False  # one call per batch: verl's batch reward manager, OpenRLHF's reward_func
    # passed to a function that names them when set to other than the default; math: its scoring
    mode: str = "strict"  # strict ("#### N") | flexible (last number)
    format_score: float = 0.0  # score for a well-formed but wrong answer
    correct_score: float = 1.0  # also validation's threshold when the function returns no "acc"
    on_error: str = "raise"  # raise | zero (score 0 and count it): a call that fails, times out or returns a non-number
    num_workers: int = 0  # processes that score rows concurrently; 0: in the driver
    timeout_s: Optional[float] = None  # bounds each call (needs num_workers >= 1); None: unbounded
    truncation_penalty: float = 0.0  # subtracted from the training score of a response cut at max_new_tokens
    overlong_buffer: int = 0  # DAPO: the last tokens of max_new_tokens where a penalty rises to overlong_penalty
    overlong_penalty: float = 1.0  # DAPO's penalty factor
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class EvalConfig:
    limit: Optional[int] = None  # evaluate the first N rows of each data_source only
    max_new_tokens: int = 256
    batch_size: int = 64  # prompts per engine call (x n samples)
    n: int = 1  # samples per prompt: accuracy is mean@n, with pass@n beside it
    temperature: Optional[float] = None  # 0: greedy; None: greedy for n=1, else sampler.temperature
    save_generations: bool = True  # validation in training writes <output_dir>/val_generations/step_N.jsonl
    output_file: Optional[str] = None  # ppo-eval's responses; default: eval.jsonl in the current folder
    reward_fn: Optional[str] = None  # the function that decides validation accuracy; null: reward.fn


@dataclass
class TrainerConfig:
    experiment_name: str = "default"
    output_dir: str = "outputs/${trainer.experiment_name}"  # fixed, so rerunning resumes
    total_steps: int = 100
    seed: int = 0
    dry_run: bool = False
    val_every: int = 10  # steps; 0 validates only before the first and after the last step
    save_every: int = 10  # steps; 0 saves only at the end
    keep_last: int = 2  # checkpoints kept; older ones are removed
    resume: str = "auto"  # auto | never (the previous run is moved aside) | a checkpoint path
    resume_allow: list[str] = field(default_factory=list)  # refused resume changes accepted knowingly (resume.py)
    stop_after_steps: Optional[int] = None  # end this invocation early (total_steps unchanged)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    log_samples: int = 4  # samples per step written to samples.jsonl
    max_skipped_steps: int = 3  # consecutive non-finite updates before the run stops
    worker_timeout_s: float = 3600.0  # a worker call (a build, a phase, a save) running longer stops the run
    collective_timeout_s: float = 600.0  # Ray: a rank waiting longer for its group's peers fails
    objective: str = "val/accuracy"  # metric returned to Hydra sweepers; checkpoints/best follows it
    objective_direction: str = "maximize"  # maximize | minimize: which objective value is best
    verbose: bool = False  # show the engines' output on the console (else it goes to <output_dir>/engine.log)


@dataclass
class PPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    gae: GaeConfig = field(default_factory=GaeConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ppo.yaml lists `ppo_schema` first in its defaults: every group option merges into it.
ConfigStore.instance().store(name="ppo_schema", node=PPOConfig)


def schema_keys(schema: type = PPOConfig, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of a schema, mapped to its field type (nested dataclasses expanded)."""
    keys: dict[str, Any] = {}
    for name, hint in get_type_hints(schema).items():
        keys[prefix + name] = hint
        if is_dataclass(hint):
            keys.update(schema_keys(hint, prefix=f"{prefix}{name}."))
    return keys


_KEYS = schema_keys()


def unknown_key_error(key: str) -> ConfigError:
    """One line for a key the schema does not have, with the nearest valid key."""
    if key.startswith("critic.lora"):
        return ConfigError(f"'{key}': LoRA on the critic is not supported; the critic (value model) is trained "
                           "full-parameter. Remove the key (LoRA for the actor is model.lora.rank).")
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


def kl_in_reward(cfg: DictConfig) -> bool:
    """The one place that resolves algorithm.use_kl_in_reward=None (not use_kl_loss); needs gae.kl_coef > 0."""
    a = cfg.algorithm
    routed = (not a.use_kl_loss) if a.use_kl_in_reward is None else a.use_kl_in_reward
    return bool(routed) and cfg.gae.kl_coef > 0


def uses_ground_truth(cfg: DictConfig) -> bool:
    """Whether a configured reward reads the data's answers: a reward function does (training's or
    validation's); a reward model does not, and a reward server gets them when there are some."""
    return cfg.reward.fn is not None or cfg.eval.reward_fn is not None


def uses_reference(cfg: DictConfig) -> bool:
    return kl_in_reward(cfg) or cfg.algorithm.use_kl_loss


def batch_arithmetic(cfg: DictConfig) -> dict[str, int]:
    """Counts per PPO step: the one place that turns prompts into sequences and optimizer steps."""
    prompts, n, a = cfg.data.train_batch_size, cfg.sampler.n, cfg.algorithm
    mini_batches = prompts // a.ppo_mini_batch_size
    return {
        "prompts_per_step": prompts,
        "sequences_per_step": prompts * n,
        "sequences_per_mini_batch": a.ppo_mini_batch_size * n,
        "mini_batches_per_epoch": mini_batches,
        "optimizer_steps_per_ppo_step": mini_batches * a.ppo_epochs,
        "max_tokens_per_sequence": cfg.data.max_prompt_length + cfg.sampler.max_new_tokens,
        "micro_batch_token_budget": a.ppo_micro_batch_tokens,
    }


def optimizer_steps(cfg: DictConfig, role: str) -> int:
    """The cosine horizon of "actor" or "critic"; the actor sits out algorithm.critic_warmup steps."""
    warmup = cfg.algorithm.critic_warmup if role == "actor" else 0
    return batch_arithmetic(cfg)["optimizer_steps_per_ppo_step"] * max(1, cfg.trainer.total_steps - warmup)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"'{key}' {message}")


def _one_of(cfg: DictConfig, allowed: tuple[str, ...], *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        _require(value in allowed, key, f"is {value!r}; allowed values: {', '.join(allowed)}")


def _lower_bound(cfg: DictConfig, op: str, low: float, *keys: str) -> None:
    """Each key's value must be `op` (">=" or ">") `low`."""
    for key in keys:
        value = OmegaConf.select(cfg, key)
        _require(value >= low if op == ">=" else value > low, key, f"must be {op} {low}, got {value}")


def _in_interval(cfg: DictConfig, interval: str, *keys: str) -> None:
    """Each key's value must lie in `interval`, written "[0, 1]", "(0, 1]", "[0, 1)" or "(0, 1)"."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    for key in keys:
        value = OmegaConf.select(cfg, key)
        ok = (low < value if interval[0] == "(" else low <= value) and (value < high if interval[-1] == ")" else value <= high)
        _require(ok, key, f"must be in {interval}, got {value}")


_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def validate_static(cfg: DictConfig) -> DictConfig:
    """The typed, resolved config; checks types, ranges and batch arithmetic, without file or device access."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(PPOConfig), cfg)
        OmegaConf.resolve(cfg)
    except ConfigKeyError as e:  # a key the schema lacks, e.g. added with `+group.key`
        raise unknown_key_error(e.full_key) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"invalid value for '{key}': {str(e).splitlines()[0]}") from None
    m, c, s, g, a, d, dev, t = cfg.model, cfg.critic, cfg.sampler, cfg.gae, cfg.algorithm, cfg.data, cfg.devices, cfg.trainer

    _one_of(cfg, ("auto", "float32", "bfloat16", "float16"), "model.dtype", "critic.dtype")
    _one_of(cfg, ("sdpa", "eager", "flash_attention_2", "flash_attention_3"), "model.attn_implementation")
    _one_of(cfg, ("constant", "cosine"), "model.optim.schedule", "critic.schedule")
    _one_of(cfg, ("hf", "vllm"), "sampler.name")
    _one_of(cfg, choices.KL_KINDS, "gae.kl_penalty", "algorithm.kl_loss_type")
    _one_of(cfg, choices.KL_CTRLS, "gae.kl_ctrl")
    _one_of(cfg, choices.LAM_MODES, "gae.lam_mode")
    _one_of(cfg, choices.ROLLOUT_CORRECTIONS, "algorithm.rollout_correction")
    _one_of(cfg, choices.AGG_MODES, "algorithm.loss_agg_mode")
    _one_of(cfg, ("local", "ray"), "devices.backend")
    _one_of(cfg, ("cpu", "cuda", "npu", "auto"), "devices.accelerator")
    _one_of(cfg, ("error", "skip"), "data.bad_rows")
    _one_of(cfg, ("strict", "flexible"), "reward.mode")
    _one_of(cfg, ("raise", "zero"), "reward.on_error")
    _one_of(cfg, ("maximize", "minimize"), "trainer.objective_direction")
    for logger in t.loggers:
        _require(logger in _LOGGERS, "trainer.loggers", f"has {logger!r}; allowed values: {', '.join(_LOGGERS)}")
    _lower_bound(cfg, ">=", 0, "model.optim.warmup_steps", "critic.warmup_steps", "gae.kl_coef",
                 "algorithm.entropy_coef", "algorithm.critic_warmup", "algorithm.kl_loss_coef", "trainer.val_every",
                 "trainer.save_every", "trainer.log_samples", "model.optim.weight_decay", "critic.weight_decay")
    _lower_bound(cfg, ">=", 1, "sampler.n", "sampler.max_new_tokens", "sampler.generate_batch_size",
                 "model.logprob_chunk_tokens", "data.train_batch_size", "data.max_prompt_length",
                 "data.arithmetic.train_size", "data.arithmetic.val_size", "algorithm.ppo_epochs", "algorithm.ppo_mini_batch_size", "devices.devices_per_node",
                 "trainer.total_steps", "trainer.keep_last", "trainer.max_skipped_steps", "eval.max_new_tokens",
                 *(f"devices.{role}.num_devices" for role in ("actor", "critic", "rollout", "reward_model")))
    _lower_bound(cfg, ">", 0, "trainer.worker_timeout_s", "trainer.collective_timeout_s", "sampler.sync_bucket_mb", "model.optim.lr", "model.optim.eps", "critic.lr",
                 "gae.adaptive_alpha", "gae.kl_target", "gae.kl_horizon")
    v = s.vllm
    _require(v.kv_cache_gb is None or v.kv_cache_gb > 0, "sampler.vllm.kv_cache_gb", f"must be > 0, got {v.kv_cache_gb}")
    _require(v.gpu_memory_utilization is None or 0 < v.gpu_memory_utilization <= 1, "sampler.vllm.gpu_memory_utilization",
             f"must be in (0, 1], got {v.gpu_memory_utilization}")
    _require(v.kv_cache_gb is None or v.gpu_memory_utilization is None, "sampler.vllm.kv_cache_gb",
             "and sampler.vllm.gpu_memory_utilization are both set: size vLLM's memory by one of them (kv_cache_gb: "
             "the KV cache in GiB; gpu_memory_utilization: a share of the GPU)")
    _require(dev.ray.num_cpus is None or dev.ray.num_cpus >= 1, "devices.ray.num_cpus",
             f"must be >= 1, or null for this machine's cores, got {dev.ray.num_cpus}")
    _require(bool(re.fullmatch(r"[\w.-]+", t.experiment_name)), "trainer.experiment_name",
             f"is {t.experiment_name!r}; it names folders (outputs/<name>): letters, digits, '.', '_' and '-' only")
    _require(cfg.reward.format_score < cfg.reward.correct_score, "reward.format_score",
             f"({cfg.reward.format_score}) must be below reward.correct_score ({cfg.reward.correct_score}): a "
             "well-formed wrong answer would count as correct")
    _in_interval(cfg, "[0, 1]", "model.optim.min_lr_ratio", "gae.gamma", "gae.lam", "data.arithmetic.two_step_fraction")
    _in_interval(cfg, "(0, 1]", "sampler.top_p")
    _in_interval(cfg, "(0, 1)", "algorithm.clip_ratio_low", "algorithm.clip_ratio_high")
    _require(g.critic_lam is None or 0 <= g.critic_lam <= 1, "gae.critic_lam",
             f"must be in [0, 1], or null for gae.lam, got {g.critic_lam}")
    _require(s.temperature > 0, "sampler.temperature", "must be > 0 (training samples; greedy is for eval)")
    _require(len(m.optim.betas) == 2 and all(0 <= b < 1 for b in m.optim.betas), "model.optim.betas",
             "must be two numbers in [0, 1)")
    _require(m.lora.rank >= 0, "model.lora.rank", "must be >= 0 (0 = full fine-tuning)")
    if m.lora.rank > 0:
        _lower_bound(cfg, ">", 0, "model.lora.alpha")
        _in_interval(cfg, "[0, 1)", "model.lora.dropout")
        _require(len(m.lora.target_modules) > 0, "model.lora.target_modules", "must name at least one module")
    _require(c.value_clip is None or c.value_clip > 0, "critic.value_clip", "must be > 0, or null to disable")
    _require(s.top_k >= 0, "sampler.top_k", "must be >= 0 (0 disables top-k)")
    _require(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", "must be > 1, or null to disable")
    _require(t.stop_after_steps is None or t.stop_after_steps >= 1, "trainer.stop_after_steps", "must be >= 1")
    _require(cfg.eval.limit is None or cfg.eval.limit >= 1, "eval.limit", "must be >= 1, or null for every row")
    _lower_bound(cfg, ">=", 1, "eval.n", "eval.batch_size")
    eval_t = cfg.eval.temperature
    _require(eval_t is None or eval_t >= 0, "eval.temperature",
             f"must be >= 0 (0: greedy), or null for greedy at eval.n=1 and sampler.temperature above, got {eval_t}")
    _require(not (eval_t == 0 and cfg.eval.n > 1), "eval.n",
             f"is {cfg.eval.n} with eval.temperature=0: greedy samples of a prompt are all the same; "
             "set eval.temperature > 0 (or null for sampler.temperature), or eval.n=1")

    for key in t.resume_allow:
        try:
            check_key(key)
        except ConfigError as e:
            raise ConfigError(f"'trainer.resume_allow' names {key!r}: {e}") from None

    objective = metric_names.objective_problem(cfg, uses_reference(cfg))
    _require(objective is None, "trainer.objective", objective or "")

    sizes = batch_arithmetic(cfg)
    seq_tokens = sizes["max_tokens_per_sequence"]
    _require(s.vllm.max_model_len is None or s.vllm.max_model_len >= seq_tokens, "sampler.vllm.max_model_len",
             f"must be >= data.max_prompt_length + sampler.max_new_tokens = {seq_tokens}")
    _require(a.ppo_micro_batch_tokens >= seq_tokens, "algorithm.ppo_micro_batch_tokens",
             f"({a.ppo_micro_batch_tokens}) must hold one full sequence: >= data.max_prompt_length + "
             f"sampler.max_new_tokens = {seq_tokens}")
    _require(d.train_batch_size % a.ppo_mini_batch_size == 0, "algorithm.ppo_mini_batch_size",
             f"({a.ppo_mini_batch_size}) must divide data.train_batch_size ({d.train_batch_size})")
    for role in ("actor", "critic"):
        replicas = dev[role].num_devices
        _require(sizes["sequences_per_mini_batch"] >= replicas, f"devices.{role}.num_devices",
                 f"({replicas}) exceeds the sequences per mini-batch ({sizes['sequences_per_mini_batch']} = "
                 "algorithm.ppo_mini_batch_size x sampler.n): every replica needs at least one")

    if g.kl_ctrl == "adaptive":  # the controller multiplies the coefficient: from 0 it never moves
        _require(g.kl_coef > 0, "gae.kl_coef", "must be > 0 with gae.kl_ctrl=adaptive (the controller scales it)")
        _require(kl_in_reward(cfg), "gae.kl_ctrl",
                 "is adaptive, but the KL is not in the reward (algorithm.use_kl_loss=true moves it into the loss); "
                 "set algorithm.use_kl_in_reward=true or gae.kl_ctrl=fixed")
    _require(not (a.use_kl_in_reward and g.kl_coef == 0), "algorithm.use_kl_in_reward",
             "is true but gae.kl_coef=0 puts no KL in the reward; set gae.kl_coef > 0")
    _require(a.rollout_correction == "none" or a.recompute_old_logprobs, "algorithm.rollout_correction",
             f"is {a.rollout_correction!r} but algorithm.recompute_old_logprobs=false: with the sampler's "
             "logprobs as the old ones every weight pi_old / pi_rollout is 1; set one of them back")
    _require(a.rollout_correction_cap >= 1, "algorithm.rollout_correction_cap",
             f"must be >= 1 (a cap below 1 truncates on-policy tokens, ratio 1), got {a.rollout_correction_cap}")
    _require(0 < a.rollout_correction_low <= 1, "algorithm.rollout_correction_low",
             f"must be in (0, 1] (an on-policy sequence, ratio 1, must be kept), got {a.rollout_correction_low}")
    _require(a.rollout_correction_high >= 1, "algorithm.rollout_correction_high",
             f"must be >= 1 (an on-policy sequence, ratio 1, must be kept), got {a.rollout_correction_high}")

    _require(len(set(d.train_files)) == len(d.train_files), "data.train_files",
             "names a file twice; list each once and weight it with data.train_weights")
    _require(not d.train_weights or len(d.train_weights) == len(d.train_files), "data.train_weights",
             f"has {len(d.train_weights)} weights for {len(d.train_files)} data.train_files; give one per file, "
             "or none to weight the files by their size")
    _require(all(w > 0 for w in d.train_weights), "data.train_weights",
             f"must all be > 0 (a file weighted 0 is never read: remove it), got {list(d.train_weights)}")
    _one_of(cfg, ("drop", "error"), "data.overlong_prompts")
    _require(bool(d.source_key), "data.source_key", "must name the key of a row's source (verl's: data_source)")
    for key in ("prompt_key", "answer_key"):
        _require(d[key] is None or bool(d[key]), f"data.{key}", "must be a key, or null for the layout's default")
    _require(d.system_prompt is None or d.use_chat_template, "data.system_prompt",
             "is set but data.use_chat_template=false has no system turn; remove it or use the chat template")
    _require(not d.chat_template_kwargs or d.use_chat_template, "data.chat_template_kwargs",
             "is set but data.use_chat_template=false renders no template; remove it or use the chat template")
    _require(d.arithmetic.max_operand >= 2, "data.arithmetic.max_operand", "must be >= 2")
    if d.source == "digits":
        _one_of(cfg, ("reverse", "sum"), "data.digits.task")
        _lower_bound(cfg, ">=", 1, "data.digits.train_size", "data.digits.val_size")
        _require(1 <= d.digits.min_length <= d.digits.length, "data.digits.min_length",
                 f"({d.digits.min_length}) must be in [1, data.digits.length={d.digits.length}]")
        answer_tokens = d.digits.length if d.digits.task == "reverse" else 1
        _require(s.max_new_tokens >= answer_tokens, "sampler.max_new_tokens",
                 f"({s.max_new_tokens}) is too short for the longest data.digits answer ({answer_tokens} tokens)")
    _reward_checks(cfg)

    if dev.backend == "local":
        for role in ("actor", "critic", "rollout", "reward_model"):
            _require(dev[role].num_devices == 1, f"devices.{role}.num_devices",
                     f"is {dev[role].num_devices}, but devices.backend=local runs one process on one device; "
                     "use devices.backend=ray for more")
    _require(s.vllm.tensor_parallel_size == 1, "sampler.vllm.tensor_parallel_size",
             f"is {s.vllm.tensor_parallel_size}, but a rollout engine spanning several devices (tensor parallelism) "
             "is not built: each rollout replica is one vLLM engine on one device. Use 1 with a model whose weights "
             "and KV cache fit one device, and devices.rollout.num_devices replicas for throughput")
    return cfg


def _reward_checks(cfg: DictConfig) -> None:
    """reward.*: the function's form, the pool, the shaping (docs/rewards.md). Its signature is
    checked where it is imported (rewards/loader.py), before any model loads."""
    r = cfg.reward
    _require(r.fn is not None or r.model.path or r.remote.url, "reward.fn",
             "is null and neither reward.model.path nor reward.remote.url is set: nothing would score the responses")
    for key in ("reward.fn", "eval.reward_fn"):
        fn = OmegaConf.select(cfg, key)
        _require(fn is None or ":" in fn, key, f"is {fn!r}; expected 'module:function' or 'path/to/file.py:function'")
    _one_of(cfg, ("auto", "float32", "bfloat16", "float16"), "reward.model.dtype")
    for part in ("model", "remote"):
        _require(r[part].clip is None or r[part].clip > 0, f"reward.{part}.clip", f"must be > 0, or null, got {r[part].clip}")
    _lower_bound(cfg, ">=", 1, "reward.remote.batch_size", "reward.remote.concurrency")
    _lower_bound(cfg, ">=", 0, "reward.remote.retries")
    _lower_bound(cfg, ">=", 0, "reward.num_workers", "reward.truncation_penalty", "reward.overlong_buffer")
    _lower_bound(cfg, ">", 0, "reward.overlong_penalty")
    _require(r.timeout_s is None or r.timeout_s > 0, "reward.timeout_s", f"must be > 0, or null for no bound, got "
             f"{r.timeout_s}")
    _require(r.timeout_s is None or r.num_workers >= 1, "reward.timeout_s",
             "needs reward.num_workers >= 1: a call in the driver cannot be stopped; set reward.num_workers=1 or more")
    _require(not (r.batched and r.num_workers > 1), "reward.num_workers",
             f"is {r.num_workers}, but a batched function (reward.batched=true) is called once per batch, on one "
             "worker; set reward.num_workers=1 (calls bounded by reward.timeout_s) or 0")
    _require(r.overlong_buffer < cfg.sampler.max_new_tokens, "reward.overlong_buffer",
             f"({r.overlong_buffer}) must be below sampler.max_new_tokens ({cfg.sampler.max_new_tokens})")
    _require(r.overlong_buffer > 0 or r.overlong_penalty == RewardConfig.overlong_penalty, "reward.overlong_penalty",
             "is set but reward.overlong_buffer=0 applies no overlong penalty; set reward.overlong_buffer (tokens)")


# --- Composition: the YAML tree in configs/, command-line overrides checked against the schema

# ppo_trainer/configs/ in an installed wheel (package data), configs/ at the root of a checkout.
CONFIG_DIR = next((d for d in (Path(__file__).parent / "configs", Path(__file__).parents[1] / "configs")
                   if (d / "ppo.yaml").is_file()), None)
if CONFIG_DIR is None:
    raise ImportError(f"ppo_trainer: no configs/ppo.yaml in {Path(__file__).parent} or its parent; the install "
                      "lacks its package data: reinstall (rm -rf build *.egg-info && pip install .)")
CONFIG_NAME = "ppo"


def group_options(group: str) -> list[str]:
    """Option names of a config group (YAML files in configs/<group>/)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def config_groups() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))


_FILE_LIST_KEY = re.compile(r"^(\+*data\.(?:train|val)_files)=([^\[].*)$")  # a single path, not [...]
_OPEN_DICT_KEY = re.compile(r"^\+*(data\.chat_template_kwargs(?:\.[^=]+)?=)")  # its keys are the template's


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Accept a single path for the list-typed file keys: `data.val_files=test.jsonl` -> `[test.jsonl]`;
    let `data.chat_template_kwargs={k: v}` and `data.chat_template_kwargs.k=v` add keys (`++`), which
    Hydra's struct mode would refuse without a `+`."""
    return [_OPEN_DICT_KEY.sub(r"++\1", _FILE_LIST_KEY.sub(r"\1=[\2]", override)) for override in overrides]


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
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = normalize_overrides(overrides)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    return validate_static(cfg)
