"""The schema: every key's type and default (configs/ says only what differs), and where the YAML
tree of group options lives. Batch sizes count prompts (x sampler.n sequences), lengths count tokens.
A field's meaning is its comment (the lines just above it and the one after it): scripts/gen_config_docs.py
turns them into docs/config.md."""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from ppo_trainer.errors import InputError


class ConfigError(InputError):
    """A config problem the user must fix; the message is one line naming the key."""


@dataclass
class LoraConfig:  # LoRA adapters on the actor (model.lora.rank > 0); the reference is the base model without them
    rank: int = 0  # adapter rank; 0 = full fine-tuning
    alpha: int = 16  # scaling of the adapters' update (alpha / rank)
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(  # the linear layers that get adapters
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class OptimConfig:  # the actor's AdamW and learning-rate schedule
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay of weight matrices (biases and norms: none)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's two moment decay rates, each in [0, 1)
    eps: float = 1e-8  # AdamW's denominator term
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class ModelConfig:  # the actor; the reference and, by default, the critic start from it
    # the actor's weights: a folder, a hub name, embedded:NAME or random:tiny
    path: str = "embedded:smollm2-135m-instruct"
    dtype: str = "auto"  # actor and rollout compute dtype; auto: bfloat16 where native, else float32
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2 | flash_attention_3
    trust_remote_code: bool = False  # run the model's own code from its folder or hub repository
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more time)
    cpu_offload: bool = False  # FSDP2 parameter and optimizer offload to host memory
    logprob_chunk_tokens: int = 1024  # tokens per chunk when computing logprobs from logits
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticConfig:  # the value model: a full-parameter backbone plus a Linear(hidden, 1) head
    path: Optional[str] = None  # the critic's starting weights; None: the actor's model.path
    dtype: str = "auto"  # as model.dtype
    gradient_checkpointing: bool = False  # as model.gradient_checkpointing
    cpu_offload: bool = False  # as model.cpu_offload
    lr: float = 1e-5  # peak learning rate of the critic's AdamW
    weight_decay: float = 0.0  # as model.optim.weight_decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # as model.optim.betas
    eps: float = 1e-8  # as model.optim.eps
    warmup_steps: int = 0  # as model.optim.warmup_steps
    schedule: str = "constant"  # constant | cosine, as model.optim.schedule
    min_lr_ratio: float = 0.0  # as model.optim.min_lr_ratio
    grad_clip: float = 1.0  # as model.optim.grad_clip
    value_clip: Optional[float] = 0.5  # values clipped to this distance from the rollout's; None: no clipping


@dataclass
class VllmConfig:  # the vLLM engine (sampler=vllm only)
    tensor_parallel_size: int = 1  # only 1: an engine spanning several devices is not built (validate_static)
    gpu_memory_utilization: Optional[float] = None  # share of a GPU for vLLM's weights and KV cache; None: 0.5
    max_model_len: Optional[int] = None  # the engine's longest sequence; None: max_prompt_length + max_new_tokens
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower generation)
    # the KV cache in GiB (vLLM's kv_cache_memory_bytes: no memory profiling); one of this and
    # gpu_memory_utilization. None: 1 GiB on a CPU, gpu_memory_utilization on a GPU
    kv_cache_gb: Optional[float] = None


@dataclass
class SamplerConfig:  # rollout generation: the engine and its sampling settings
    name: str = "hf"  # hf | vllm
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # sampling temperature of training rollouts (> 0)
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this total probability
    top_k: int = 0  # keep the k most likely tokens; 0 disables top-k
    max_new_tokens: int = 256  # the longest response, in tokens
    stop: list[str] = field(default_factory=list)  # strings that end a response (kept in it)
    ignore_eos: bool = False  # generate max_new_tokens every time (benchmarks)
    generate_batch_size: int = 64  # sequences per HF generate call (bounds memory); hf only
    sync_bucket_mb: float = 128.0  # weight sync: MiB per bucket streamed from the actor to each rollout replica
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class GaeConfig:  # advantages and returns (GAE) and the KL penalty in the reward
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # lambda of the policy's advantages
    critic_lam: Optional[float] = None  # lambda of the critic's returns (VC-PPO); None: gae.lam
    lam_mode: str = "fixed"  # fixed | adaptive: per-sequence 1 - 1/(adaptive_alpha * length) (VAPO)
    adaptive_alpha: float = 0.05  # the alpha of lam_mode=adaptive
    kl_coef: float = 0.001  # KL penalty in the reward (when algorithm.use_kl_in_reward); 0 disables it
    kl_penalty: str = "k1"  # k1 | abs | k2 | k3
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_target: float = 6.0  # adaptive controller: target KL per sequence
    kl_horizon: int = 10000  # adaptive controller: horizon in sequences
    normalize_advantages: bool = True  # whiten the advantages over the batch's response tokens
    # normalize_advantages also divides by the std; false: subtracts the mean only (OpenRLHF's
    # --algo.advantage.no_std_norm), and needs normalize_advantages=true
    advantage_std_scale: bool = True


@dataclass
class AlgorithmConfig:  # the PPO update: epochs, mini-batches, clipping, loss terms
    ppo_epochs: int = 1  # passes over each step's rollouts
    ppo_mini_batch_size: int = 8  # prompts per mini-batch (x sampler.n sequences)
    ppo_micro_batch_tokens: int = 4096  # tokens of one forward/backward per device (a shared prompt counts once)
    clip_ratio_low: float = 0.2  # the ratio pi / pi_old is clipped below at 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # and above at 1 + clip_ratio_high (DAPO's clip-higher when larger)
    dual_clip: Optional[float] = None  # c > 1 bounds the loss of negative advantages
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    entropy_coef: float = 0.0  # weight of the entropy bonus in the actor's loss
    critic_warmup: int = 0  # PPO steps that update only the critic
    use_kl_loss: bool = False  # KL to the reference as a loss term (kl_loss_coef, kl_loss_type)
    use_kl_in_reward: Optional[bool] = None  # KL penalty in the reward (gae.kl_coef); None: not use_kl_loss
    kl_loss_coef: float = 0.001  # use_kl_loss: weight of the KL term
    kl_loss_type: str = "k3"  # use_kl_loss: the KL estimator, k1 | abs | k2 | k3
    recompute_old_logprobs: bool = True  # False: use the sampler's logprobs as old logprobs
    rollout_correction: str = "none"  # none | tis | mis: weights pi_old / pi_rollout on the policy loss
    rollout_correction_cap: float = 2.0  # tis: token weights truncated at this value
    rollout_correction_low: float = 0.5  # mis: a sequence whose geometric-mean ratio is below gets no policy loss
    rollout_correction_high: float = 2.0  # mis: a sequence whose geometric-mean ratio is above gets no policy loss
    shuffle_mini_batches: bool = True  # prompts (with their samples) in a new order every epoch


@dataclass
class DeviceRoleConfig:  # the devices of one role
    num_devices: int = 1  # devices of the role, one process each (replicas, sharded with FSDP2 for actor and critic)


@dataclass
class RayConfig:  # the Ray cluster to join or start (devices.backend=ray)
    # the cluster to join: HOST:PORT, [IPv6]:PORT; None: start a local Ray bound to 127.0.0.1
    address: Optional[str] = None
    num_cpus: Optional[int] = None  # logical CPUs to declare when starting Ray
    dashboard: bool = False  # start Ray's dashboard with a local Ray


@dataclass
class DevicesConfig:  # where the roles run: backend, accelerator, devices per role
    backend: str = "local"  # local | ray
    accelerator: str = "cpu"  # cpu | cuda | npu | auto
    colocate: bool = False  # all roles share the actor's devices
    devices_per_node: int = 8  # accelerators per node, for placing roles across nodes
    actor: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    critic: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    rollout: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    reward_model: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)  # with reward.model.path
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class ArithmeticConfig:  # the built-in generator of easy GSM8K-format word problems
    train_size: int = 20000  # distinct training problems
    val_size: int = 256  # distinct validation problems (none of them in training)
    max_operand: int = 20  # the largest number in a problem
    two_step_fraction: float = 0.3  # share of problems with two operations
    seed: int = 0  # draws of the problems


@dataclass
class DigitsConfig:  # tasks for the tiny model with data.source=digits (data/digits.py)
    task: str = "reverse"  # reverse (a digit string backwards) | sum (two digits, one-digit sum)
    min_length: int = 1  # reverse: training strings have min_length..length digits
    length: int = 3  # reverse: digits of the validation strings (held out from training)
    train_size: int = 3000  # training rows (one epoch of the prompt loader)
    val_size: int = 100  # reverse: distinct held-out strings; sum: validation is all 55 pairs
    seed: int = 0  # draws of the training rows


@dataclass
class DataConfig:  # the training and validation prompts and how they become chat prompts
    source: str = "arithmetic"  # arithmetic | digits | files | a hub dataset name (openai/gsm8k)
    hub_config: Optional[str] = None  # e.g. "main" for openai/gsm8k
    train_split: str = "train"  # the split of a hub dataset to train on
    val_split: str = "test"  # the split of a hub dataset to validate on
    # training files, jsonl or parquet; a split with files reads them, whatever `source` says
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)  # validation files, as train_files
    train_weights: list[float] = field(default_factory=list)  # one per train file; []: by size
    # the row's prompt (text or a message list). None: verl's layout ("prompt",
    # "reward_model.ground_truth") for a file whose first row has a reward_model, else "question",
    # "answer". A dotted key is a path into nested objects.
    prompt_key: Optional[str] = None
    answer_key: Optional[str] = None  # the row's ground-truth answer; None: as prompt_key
    source_key: str = "data_source"  # a row's source; rows without it: the generator, dataset or file name
    train_batch_size: int = 8  # prompts per PPO step
    max_prompt_length: int = 256  # the longest prompt, in tokens (longer ones: data.overlong_prompts)
    overlong_prompts: str = "drop"  # drop (counted per source) | error: prompts over max_prompt_length
    bad_rows: str = "error"  # error | skip (with a count)
    shuffle: bool = True  # training prompts in a new order every epoch
    # instruction and prompt_template shape string prompts; a message-list prompt is used as it is
    instruction: str = "Let's think step by step and output the final answer after \"####\"."
    prompt_template: str = "{question} {instruction}"  # user message, then the chat template
    use_chat_template: bool = True  # render prompts with the tokenizer's chat template
    system_prompt: Optional[str] = None  # None: the template's default; a system turn in the data wins
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    digits: DigitsConfig = field(default_factory=DigitsConfig)


@dataclass
class RewardModelConfig:  # a learned reward: a sequence classifier (docs/rewards.md)
    path: Optional[str] = None  # a sequence classifier with one label: a folder, a hub name, random:tiny-reward
    coef: float = 1.0  # its weight in the training score
    dtype: str = "auto"  # as model.dtype
    trust_remote_code: bool = False  # its own: model.trust_remote_code does not extend to it
    normalize: bool = False  # scores standardised by their running mean and std (kept in the checkpoint)
    clip: Optional[float] = None  # then clipped to [-clip, clip]; None: not clipped


@dataclass
class RemoteRewardConfig:  # a reward server speaking OpenRLHF's protocol (docs/rewards.md)
    url: Optional[str] = None  # e.g. http://127.0.0.1:5000/get_reward
    coef: float = 1.0  # its weight in the training score
    # bearer token; null: $PPO_REWARD_TOKEN. Given on the command line it moves there (Hydra's lines and files
    # never show it); saved and printed configs mask it
    token: Optional[str] = None
    batch_size: int = 64  # rows per request
    concurrency: int = 4  # requests in flight
    retries: int = 3  # after a connection error, a 5xx or a 429 answer, with doubling waits from 1 s (429: Retry-After)
    timeout_s: float = 60.0  # bounds each request: connect, send, the whole answer, its retries and their waits
    use_proxy: bool = False  # true: through $http_proxy/$https_proxy (they see the token); false: straight to the URL
    normalize: bool = False  # as reward.model.normalize
    clip: Optional[float] = None  # as reward.model.clip


@dataclass
class RewardConfig:  # the score of a response: a function, a reward model or a server, then shaping (docs/rewards.md)
    # module:function or path/to/file.py:function; null: no function (a reward model or server scores)
    fn: Optional[str] = "ppo_trainer.rewards.math:score"
    batched: bool = False  # one call per batch: verl's batch reward manager, OpenRLHF's reward_func
    # mode, format_score and correct_score are passed to a function that names them when set to other
    # than the default. The math function's scoring: strict ("#### N") | flexible (last number)
    mode: str = "strict"
    format_score: float = 0.0  # score for a well-formed but wrong answer
    correct_score: float = 1.0  # also validation's threshold when the function returns no "acc"
    on_error: str = "raise"  # raise | zero (score 0 and count it): a call that fails, times out or returns a non-number
    num_workers: int = 0  # processes that score rows concurrently; 0: in the driver
    # bounds each call of a reward function (needs num_workers >= 1); None: unbounded. Servers: remote.timeout_s
    timeout_s: Optional[float] = None
    truncation_penalty: float = 0.0  # subtracted from the training score of a response cut at max_new_tokens
    overlong_buffer: int = 0  # DAPO: the last tokens of max_new_tokens where a penalty rises to overlong_penalty
    overlong_penalty: float = 1.0  # DAPO's penalty factor
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class EvalConfig:  # validation during training and ppo-eval
    limit: Optional[int] = None  # evaluate the first N rows of each data_source only
    max_new_tokens: int = 256  # the longest validation response, in tokens
    batch_size: int = 64  # prompts per engine call (x n samples)
    n: int = 1  # samples per prompt: accuracy is mean@n, with pass@n beside it
    temperature: Optional[float] = None  # 0: greedy; None: greedy for n=1, else sampler.temperature
    save_generations: bool = True  # validation in training writes <output_dir>/val_generations/step_N.jsonl
    output_file: Optional[str] = None  # ppo-eval's responses; default: eval.jsonl in the current folder
    reward_fn: Optional[str] = None  # the function that decides validation accuracy; null: reward.fn


@dataclass
class TrainerConfig:  # the run: steps, cadences, checkpoints, resume, logging
    experiment_name: str = "default"  # names the run's folders (outputs/<name>) and metrics
    output_dir: str = "outputs/${trainer.experiment_name}"  # the run's folder; fixed, so rerunning resumes
    total_steps: int = 100  # PPO steps (each: rollouts of data.train_batch_size prompts, then the updates)
    seed: int = 0  # seeds sampling, shuffling and initial weights
    dry_run: bool = False  # print the plan (placement, batch sizes, memory) and the environment checks, then exit
    val_every: int = 10  # validation every N steps; 0 validates only before the first and after the last step
    save_every: int = 10  # a checkpoint every N steps; 0 saves only at the end
    keep_last: int = 2  # checkpoints kept; older ones are removed
    # auto | never (the previous run is moved aside) | a checkpoint: its global_step_N folder, a
    # checkpoints/latest or checkpoints/best pointer (the step it names), or a run folder (its latest)
    resume: str = "auto"
    resume_allow: list[str] = field(default_factory=list)  # refused resume changes accepted knowingly (resume.py)
    stop_after_steps: Optional[int] = None  # end this invocation early (total_steps unchanged)
    # any of console | jsonl | tensorboard | wandb | mlflow
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


# ppo_trainer/config/yaml_tree/ in an installed wheel (package data), configs/ at the root of a checkout.
CONFIG_DIR = next((d for d in (Path(__file__).parent / "yaml_tree", Path(__file__).parents[2] / "configs")
                   if (d / "ppo.yaml").is_file()), None)
if CONFIG_DIR is None:
    raise ImportError(f"ppo_trainer: no ppo.yaml in {Path(__file__).parent / 'yaml_tree'} or the checkout's configs/; "
                      "the install lacks its package data: reinstall (rm -rf build *.egg-info && pip install .)")
CONFIG_NAME = "ppo"


def group_options(group: str) -> list[str]:
    """Option names of a config group (YAML files in configs/<group>/)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def config_groups() -> list[str]:
    """The config groups (folders of configs/): the schema's sections, experiment and sweep."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))
