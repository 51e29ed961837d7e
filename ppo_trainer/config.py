"""The schema: every key's type and default (configs/ says only what differs), and where the YAML
tree of group options lives. Batch sizes count prompts (x sampler.n sequences), lengths count tokens."""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore


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
    """The config groups (folders of configs/): the schema's sections, experiment and sweep."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))
