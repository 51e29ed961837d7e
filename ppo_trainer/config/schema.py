"""The schema: every key's type, default and allowed values (configs/ says only what differs), and
where the YAML tree of group options lives. Batch sizes count prompts (x sampler.n sequences), lengths
count tokens. A field's meaning is its comment (the lines just above it and the one after it); its
allowed values are its `Rule` (`field(metadata=at_least(0))`): config/validation.py checks every
field against its rule in one loop, scripts/gen_config_docs.py prints both into docs/config.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore

from ppo_trainer.core import choices
from ppo_trainer.errors import InputError


class ConfigError(InputError):
    """A config problem the user must fix; the message is one line naming the key."""


@dataclass(frozen=True)
class Rule:
    """The values a field accepts, written beside its default by the helpers below. A list field's
    rule holds for each element. A null is accepted where the type allows it (Optional); `null` says
    what it means and `why` explains the bound (a choice's `why` replaces the list of allowed values:
    it says what to do), both in the error message."""

    allowed: tuple[Any, ...] = ()  # one of these values
    op: str = ""  # ">=" or ">" than `low`
    low: float = 0
    interval: str = ""  # "[0, 1]", "(0, 1]", "[0, 1)" or "(0, 1)"
    pattern: str = ""  # a regular expression the whole string matches, described by `expected`
    expected: str = ""
    length: Optional[int] = None  # a list of exactly this many values
    why: str = ""
    null: str = ""

    def describe(self) -> str:
        """The accepted values as docs/config.md and the error messages write them: `a, b`, `>= 0`, `in [0, 1]`."""
        if self.allowed:
            return ", ".join(str(a) for a in self.allowed)
        if self.pattern:
            return self.expected
        return f"{self.op} {self.low}" if self.op else f"in {self.interval}"


def choice(*allowed: Any, why: str = "") -> dict[str, Rule]:
    return {"rule": Rule(allowed=allowed, why=why)}


def at_least(low: float, why: str = "", null: str = "") -> dict[str, Rule]:
    return {"rule": Rule(op=">=", low=low, why=why, null=null)}


def above(low: float, why: str = "", null: str = "") -> dict[str, Rule]:
    return {"rule": Rule(op=">", low=low, why=why, null=null)}


def within(interval: str, length: Optional[int] = None, why: str = "", null: str = "") -> dict[str, Rule]:
    return {"rule": Rule(interval=interval, length=length, why=why, null=null)}


def matching(pattern: str, expected: str, why: str = "", null: str = "") -> dict[str, Rule]:
    return {"rule": Rule(pattern=pattern, expected=expected, why=why, null=null)}


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
FUNCTION = matching(r".*:.*", "'module:function' or 'path/to/file.py:function'")
ROW_KEY = matching(".+", "a non-empty key", null="for the layout's default")


@dataclass
class LoraConfig:  # LoRA adapters (rank > 0) of the actor (its reference: the base without them) or the critic
    rank: int = field(default=0, metadata=at_least(0, why="0 = full fine-tuning"))  # adapter rank; 0 = full fine-tuning
    alpha: int = field(default=16, metadata=above(0))  # scaling of the adapters' update (alpha / rank)
    dropout: float = field(default=0.0, metadata=within("[0, 1)"))  # dropout on the adapters' input
    target_modules: list[str] = field(  # the linear layers that get adapters
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class OptimConfig:  # AdamW and its learning-rate schedule: the actor's (model.optim) and the critic's (critic.optim)
    lr: float = field(default=1e-6, metadata=above(0))  # peak learning rate
    # AdamW weight decay of weight matrices (biases and norms: none)
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    # AdamW's two moment decay rates
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=within("[0, 1)", length=2))
    eps: float = field(default=1e-8, metadata=above(0))  # AdamW's denominator term
    warmup_steps: int = field(default=0, metadata=at_least(0))  # optimizer steps of linear warm-up
    schedule: str = field(default="constant", metadata=choice("constant", "cosine"))  # the learning rate after warm-up
    min_lr_ratio: float = field(default=0.0, metadata=within("[0, 1]"))  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class ModelConfig:  # the actor; the reference and, by default, the critic start from it
    # the actor's weights: a folder, a hub name, embedded:NAME or random:tiny
    path: str = "embedded:smollm2-135m-instruct"
    # actor and rollout compute dtype; auto: bfloat16 where native, else float32
    dtype: str = field(default="auto", metadata=choice(*DTYPES))
    attn_implementation: str = field(  # the attention kernel of the actor, the reference and the critic
        default="sdpa", metadata=choice("sdpa", "eager", "flash_attention_2", "flash_attention_3"))
    trust_remote_code: bool = False  # run the model's own code from its folder or hub repository
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more time)
    cpu_offload: bool = False  # FSDP2 parameter and optimizer offload to host memory
    # tokens per chunk when computing logprobs from logits
    logprob_chunk_tokens: int = field(default=1024, metadata=at_least(1))
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticConfig:  # the value model: a backbone (full-parameter, or LoRA: critic.lora) plus a Linear(hidden, 1) head
    path: Optional[str] = None  # the critic's starting weights; None: the actor's model.path
    dtype: str = field(default="auto", metadata=choice(*DTYPES))  # as model.dtype
    gradient_checkpointing: bool = False  # as model.gradient_checkpointing
    cpu_offload: bool = False  # as model.cpu_offload
    # values clipped to this distance from the rollout's; None: no clipping
    value_clip: Optional[float] = field(default=0.5, metadata=above(0, null="to disable"))
    # the critic's passes over each step's rollouts (verl's critic.ppo_epochs); None: algorithm.ppo_epochs
    ppo_epochs: Optional[int] = field(default=None, metadata=at_least(1, null="for algorithm.ppo_epochs"))
    # the value head's start: loaded (a saved critic's head, a reward model's score head, else zeros) or
    # regression: refitted before the first values, backbone frozen, by ridge regression on step 1's
    # Monte Carlo returns (docs/learning.md)
    value_head_init: str = field(default="loaded", metadata=choice(*choices.VALUE_HEAD_INITS))
    # LoRA adapters on the backbone, as model.lora (verl's critic.model.lora_rank); the value head is trained in full
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # the critic's own AdamW, as in verl


@dataclass
class VllmConfig:  # the vLLM engine (sampler=vllm only)
    # tensor parallelism: devices per rollout replica, one vLLM engine whose k ranks (one per device, all on
    # one node) each hold 1/k of the weights and attention heads; devices.rollout.num_devices / k replicas.
    # devices.backend=ray, not colocated (docs/cluster.md)
    tensor_parallel_size: int = field(default=1, metadata=at_least(1))
    # share of a GPU for vLLM's weights and KV cache; None: 0.5
    gpu_memory_utilization: Optional[float] = field(default=None, metadata=within("(0, 1]", null="for 0.5"))
    max_model_len: Optional[int] = None  # the engine's longest sequence; None: max_prompt_length + max_new_tokens
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower generation)
    # the KV cache in GiB (vLLM's kv_cache_memory_bytes: no memory profiling); one of this and
    # gpu_memory_utilization. None: 1 GiB on a CPU, gpu_memory_utilization on a GPU
    kv_cache_gb: Optional[float] = field(default=None, metadata=above(0))


@dataclass
class MultiTurnConfig:  # multi-turn rollouts: an environment and/or tools answer the policy (docs/multi-turn.md)
    # the environment: "module:Class" or "path/to/file.py:Class" with reset(states) and step(states),
    # OpenRLHF's AgentInstanceBase shape; one instance per episode. None: no environment
    env: Optional[str] = None
    # tools the policy may call: "calculator" and "python" (built in), or "module:function" /
    # "path/to/file.py:function" with type hints and a docstring (its OpenAI function schema)
    tools: list[str] = field(default_factory=list)
    max_turns: int = field(default=3, metadata=at_least(1))  # assistant turns per episode
    # an observation (tool results or the environment's feedback) is cut to this many tokens
    max_observation_tokens: int = field(default=64, metadata=at_least(1))
    # the whole response block (assistant turns and observations); None: max_turns x (sampler.max_new_tokens
    # + max_observation_tokens)
    max_response_tokens: Optional[int] = field(default=None, metadata=at_least(1))
    # seconds for one tool call or one environment reset/step; past it the policy sees an error observation
    tool_timeout_s: float = field(default=10.0, metadata=above(0))
    # the built-in python tool's address-space limit in MiB (a guard against accidents, not a sandbox)
    python_memory_mb: int = field(default=1024, metadata=at_least(64))


@dataclass
class SamplerConfig:  # rollout generation: the engine and its sampling settings
    name: str = field(default="hf", metadata=choice("hf", "vllm"))  # the engine: Hugging Face generate or vLLM
    n: int = field(default=1, metadata=at_least(1))  # samples per prompt
    # sampling temperature of training rollouts
    temperature: float = field(default=1.0, metadata=above(0, why="training samples; greedy is for eval"))
    # nucleus sampling: keep the smallest set of tokens with this total probability
    top_p: float = field(default=1.0, metadata=within("(0, 1]"))
    top_k: int = field(default=0, metadata=at_least(0, why="0 disables top-k"))  # keep the k most likely tokens
    max_new_tokens: int = field(default=256, metadata=at_least(1))  # the longest response, in tokens
    stop: list[str] = field(default_factory=list)  # strings that end a response (kept in it)
    ignore_eos: bool = False  # generate max_new_tokens every time (benchmarks)
    # sequences per HF generate call (bounds memory); hf only
    generate_batch_size: int = field(default=64, metadata=at_least(1))
    # weight sync: MiB per bucket streamed from the actor to each rollout replica
    sync_bucket_mb: float = field(default=128.0, metadata=above(0))
    # how many policy versions a step's samples may lag (asynchronous rollouts, docs/async.md): step s trains
    # on samples generated with the weights after step max(0, s-1-max_staleness), so the next batches
    # generate while this one trains. 0: lock-step, each step samples with the weights it updates. >= 1:
    # devices.backend=ray, algorithm.rollout_correction tis or mis, not colocated on GPUs or NPUs
    max_staleness: int = field(default=0, metadata=at_least(0, why="0 is lock-step"))
    # samples still generating at a weight sync continue under the new weights instead of the sync waiting
    # for them (a sample may then span policy versions, each token recording its own: docs/async.md);
    # sampler=vllm with max_staleness >= 1, single-turn or tools (no sampler.multi_turn.env)
    partial_rollouts: bool = False
    vllm: VllmConfig = field(default_factory=VllmConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class GaeConfig:  # advantages and returns (GAE) and the KL penalty in the reward
    gamma: float = field(default=1.0, metadata=within("[0, 1]"))  # discount per token
    lam: float = field(default=1.0, metadata=within("[0, 1]"))  # lambda of the policy's advantages
    # lambda of the critic's returns (VC-PPO); None: gae.lam
    critic_lam: Optional[float] = field(default=None, metadata=within("[0, 1]", null="for gae.lam"))
    # adaptive: per-sequence 1 - 1/(adaptive_alpha * length) (VAPO)
    lam_mode: str = field(default="fixed", metadata=choice(*choices.LAM_MODES))
    adaptive_alpha: float = field(default=0.05, metadata=above(0))  # the alpha of lam_mode=adaptive
    # KL penalty in the reward (when algorithm.use_kl_in_reward); 0 disables it
    kl_coef: float = field(default=0.001, metadata=at_least(0))
    kl_penalty: str = field(default="k1", metadata=choice(*choices.KL_KINDS))  # the KL estimator of the penalty
    kl_ctrl: str = field(default="fixed", metadata=choice(*choices.KL_CTRLS))  # the KL coefficient's controller
    kl_target: float = field(default=6.0, metadata=above(0))  # adaptive controller: target KL per sequence
    kl_horizon: int = field(default=10000, metadata=above(0))  # adaptive controller: horizon in sequences
    # whiten the advantages over the batch's response tokens; GAE's only (algorithm.adv_estimator=gae): the
    # critic-free estimators own their normalisation (docs/learning.md#estimators)
    normalize_advantages: bool = True
    # normalize_advantages also divides by the std; false: subtracts the mean only (OpenRLHF's
    # --algo.advantage.no_std_norm), and needs normalize_advantages=true
    advantage_std_scale: bool = True


@dataclass
class AlgorithmConfig:  # the PPO update: epochs, mini-batches, clipping, loss terms
    # the advantages (verl's name): gae (the critic's values, the gae section), or critic-free, which builds no
    # critic: grpo, rloo (a prompt's sampler.n >= 2 samples against each other), reinforce_plus_plus
    adv_estimator: str = field(default="gae", metadata=choice(*choices.ADV_ESTIMATORS))
    # grpo: divide by the group's std (verl's name); false: subtract the group's mean only (Dr. GRPO)
    norm_adv_by_std_in_grpo: bool = True
    ppo_epochs: int = field(default=1, metadata=at_least(1))  # passes over each step's rollouts
    ppo_mini_batch_size: int = field(default=8, metadata=at_least(1))  # prompts per mini-batch (x sampler.n sequences)
    ppo_micro_batch_tokens: int = 4096  # tokens of one forward/backward per device (a shared prompt counts once)
    # several prompts' sequences per row, up to the longest, instead of padding every row to it (verl's
    # use_remove_padding, OpenRLHF's --packing_samples): the same losses on fewer tokens (docs/performance.md)
    pack_sequences: bool = False
    # the ratio pi / pi_old is clipped below at 1 - clip_ratio_low
    clip_ratio_low: float = field(default=0.2, metadata=within("(0, 1)"))
    # and above at 1 + clip_ratio_high (DAPO's clip-higher when larger)
    clip_ratio_high: float = field(default=0.2, metadata=within("(0, 1)"))
    # c > 1 bounds the loss of negative advantages
    dual_clip: Optional[float] = field(default=None, metadata=above(1, null="to disable"))
    loss_agg_mode: str = field(default="token-mean", metadata=choice(*choices.AGG_MODES))  # how token losses make the loss
    entropy_coef: float = field(default=0.0, metadata=at_least(0))  # weight of the entropy bonus in the actor's loss
    # PPO steps that update only the critic; with critic_warmup_explained_var, the most
    critic_warmup: int = field(default=0, metadata=at_least(0))
    # the critic warm-up ends after the step whose critic/vf_explained_var reaches this (VAPO's value
    # pre-training); None: it lasts algorithm.critic_warmup steps
    critic_warmup_explained_var: Optional[float] = field(default=None, metadata=within(
        "(0, 1]", null="for a warm-up of exactly algorithm.critic_warmup steps"))
    use_kl_loss: bool = False  # KL to the reference as a loss term (kl_loss_coef, kl_loss_type)
    use_kl_in_reward: Optional[bool] = None  # KL penalty in the reward (gae.kl_coef); None: not use_kl_loss
    kl_loss_coef: float = field(default=0.001, metadata=at_least(0))  # use_kl_loss: weight of the KL term
    kl_loss_type: str = field(default="k3", metadata=choice(*choices.KL_KINDS))  # use_kl_loss: the KL estimator
    recompute_old_logprobs: bool = True  # False: use the sampler's logprobs as old logprobs
    # tis | mis: weights pi_old / pi_rollout on the policy loss
    rollout_correction: str = field(default="none", metadata=choice(*choices.ROLLOUT_CORRECTIONS))
    rollout_correction_cap: float = field(  # tis: token weights truncated at this value
        default=2.0, metadata=at_least(1, why="a cap below 1 truncates on-policy tokens, ratio 1"))
    rollout_correction_low: float = field(  # mis: a sequence whose geometric-mean ratio is below gets no policy loss
        default=0.5, metadata=within("(0, 1]", why="an on-policy sequence, ratio 1, must be kept"))
    rollout_correction_high: float = field(  # mis: a sequence whose geometric-mean ratio is above gets no policy loss
        default=2.0, metadata=at_least(1, why="an on-policy sequence, ratio 1, must be kept"))
    shuffle_mini_batches: bool = True  # prompts (with their samples) in a new order every epoch
    # weight of VAPO's positive-example language-model loss in the actor's loss: the mean NLL of the
    # tokens of positive_lm_examples; 0 disables it
    positive_lm_loss_coef: float = field(default=0.0, metadata=at_least(0))
    # the responses it imitates: correct (score >= reward.correct_score) or group_best (the top score
    # of their prompt's group, when above the group's lowest)
    positive_lm_examples: str = field(default="correct", metadata=choice(*choices.POSITIVE_EXAMPLES))
    # DAPO's dynamic sampling (verl's algorithm.filter_groups.enable): drop the prompts whose sampler.n >= 2
    # samples all score the same and draw more prompts until data.train_batch_size are kept (lock-step only)
    filter_groups: bool = False
    # what must differ within a group: score (the shaped score trained on) or acc (score >= reward.correct_score)
    filter_groups_metric: str = "score"
    # generation rounds per step at most (verl's max_num_gen_batches); the last one's groups fill the rest
    filter_groups_max_draws: int = field(default=10, metadata=at_least(1))


@dataclass
class DeviceRoleConfig:  # the devices of one role
    # devices of the role, one process each (replicas, sharded with FSDP2 for actor and critic)
    num_devices: int = field(default=1, metadata=at_least(1))


@dataclass
class RayConfig:  # the Ray cluster to join or start (devices.backend=ray)
    # the cluster to join: HOST:PORT, [IPv6]:PORT; None: start a local Ray bound to 127.0.0.1
    address: Optional[str] = None
    # logical CPUs to declare when starting Ray; None: this machine's cores
    num_cpus: Optional[int] = field(default=None, metadata=at_least(1, null="for this machine's cores"))
    dashboard: bool = False  # start Ray's dashboard with a local Ray


@dataclass
class DevicesConfig:  # where the roles run: backend, accelerator, devices per role
    backend: str = field(default="local", metadata=choice("local", "ray"))  # one process, or Ray actors
    accelerator: str = field(default="cpu", metadata=choice("cpu", "cuda", "npu", "auto"))  # the roles' device type
    colocate: bool = False  # all roles share the actor's devices
    # accelerators per node, for placing roles across nodes
    devices_per_node: int = field(default=8, metadata=at_least(1))
    actor: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    critic: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    rollout: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)
    reward_model: DeviceRoleConfig = field(default_factory=DeviceRoleConfig)  # with reward.model.path
    ray: RayConfig = field(default_factory=RayConfig)


ARITHMETIC_OPERATIONS = ("+", "-", "*", "/")  # the one-step problems of data/arithmetic.py, by operation
ARITHMETIC_TWO_STEP = ("+-", "*+", "*-")  # its two-step problems: the first operation, then the second


@dataclass
class ArithmeticConfig:  # the built-in generator of easy GSM8K-format word problems (docs/data.md)
    train_size: int = field(default=20000, metadata=at_least(1))  # distinct training problems
    val_size: int = field(default=256, metadata=at_least(1))  # distinct validation problems (none of them in training)
    max_operand: int = field(default=20, metadata=at_least(2))  # the largest number in a training problem
    # share of training problems with two operations
    two_step_fraction: float = field(default=0.3, metadata=within("[0, 1]"))
    # the operations of training problems; a two-step problem needs both of its own (+ then -, * then +, * then -)
    operations: list[str] = field(default_factory=lambda: list(ARITHMETIC_OPERATIONS),
                                  metadata=choice(*ARITHMETIC_OPERATIONS))
    seed: int = 0  # draws of the training problems
    # the validation set's largest number (the set has every operation); None: max_operand's. Set it (and
    # val_two_step_fraction) to keep the frozen set when the training curriculum changes
    val_max_operand: Optional[int] = field(default=None, metadata=at_least(2, null="for max_operand's"))
    # the validation set's share of two-step problems; None: two_step_fraction's
    val_two_step_fraction: Optional[float] = field(default=None, metadata=within(
        "[0, 1]", null="for two_step_fraction's"))
    # a second frozen validation set, data_source arithmetic/hard: two operations each; 0: none
    hard_val_size: int = field(default=0, metadata=at_least(0))
    hard_max_operand: int = field(default=50, metadata=at_least(2))  # the hard set's largest number


@dataclass
class DigitsConfig:  # tasks for the tiny model with data.source=digits (data/digits.py)
    # reverse (a digit string backwards) | sum (two digits, one-digit sum) | reveal (a hidden digit that
    # the environment ppo_trainer.agents.tasks:RevealDigit shows after a wrong first guess: multi-turn)
    task: str = field(default="reverse", metadata=choice("reverse", "sum", "reveal"))
    min_length: int = field(default=1, metadata=at_least(1))  # reverse: training strings have min_length..length digits
    # reverse: digits of the validation strings (held out from training); reveal: of the prompt's noise
    length: int = field(default=3, metadata=at_least(1))
    train_size: int = field(default=3000, metadata=at_least(1))  # training rows (one epoch of the prompt loader)
    # reverse: distinct held-out strings; sum: validation is all 55 pairs
    val_size: int = field(default=100, metadata=at_least(1))
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
    # one per train file; []: by size
    train_weights: list[float] = field(default_factory=list, metadata=above(
        0, why="a file weighted 0 is never read: remove it"))
    # the row's prompt (text or a message list). None: verl's layout ("prompt",
    # "reward_model.ground_truth") for a file whose first row has a reward_model, else "question",
    # "answer". A dotted key is a path into nested objects.
    prompt_key: Optional[str] = field(default=None, metadata=ROW_KEY)
    # the row's ground-truth answer; None: as prompt_key
    answer_key: Optional[str] = field(default=None, metadata=ROW_KEY)
    # a row's source; rows without it: the generator, dataset or file name
    source_key: str = field(default="data_source", metadata=matching(".+", "a non-empty key", why="verl's: data_source"))
    train_batch_size: int = field(default=8, metadata=at_least(1))  # prompts per PPO step
    # the longest prompt, in tokens (longer ones: data.overlong_prompts)
    max_prompt_length: int = field(default=256, metadata=at_least(1))
    # prompts over max_prompt_length: dropped (counted per source), or an error
    overlong_prompts: str = field(default="drop", metadata=choice("drop", "error"))
    # a malformed row: an error, or skipped (with a count)
    bad_rows: str = field(default="error", metadata=choice("error", "skip"))
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
    dtype: str = field(default="auto", metadata=choice(*DTYPES))  # as model.dtype
    trust_remote_code: bool = False  # its own: model.trust_remote_code does not extend to it
    normalize: bool = False  # scores standardised by their running mean and std (kept in the checkpoint)
    clip: Optional[float] = field(default=None, metadata=above(0))  # then clipped to [-clip, clip]; None: not clipped


@dataclass
class RemoteRewardConfig:  # a reward server speaking OpenRLHF's protocol (docs/rewards.md)
    url: Optional[str] = None  # e.g. http://127.0.0.1:5000/get_reward
    coef: float = 1.0  # its weight in the training score
    # bearer token; null: $PPO_REWARD_TOKEN. Given on the command line it moves there (Hydra's lines and files
    # never show it); saved and printed configs mask it
    token: Optional[str] = None
    batch_size: int = field(default=64, metadata=at_least(1))  # rows per request
    concurrency: int = field(default=4, metadata=at_least(1))  # requests in flight
    # after a connection error, a 5xx or a 429 answer, with doubling waits from 1 s (429: Retry-After)
    retries: int = field(default=3, metadata=at_least(0))
    # bounds each request: connect, send, the whole answer, its retries and their waits
    timeout_s: float = field(default=60.0, metadata=above(0))
    use_proxy: bool = False  # true: through $http_proxy/$https_proxy (they see the token); false: straight to the URL
    normalize: bool = False  # as reward.model.normalize
    clip: Optional[float] = field(default=None, metadata=above(0))  # as reward.model.clip


@dataclass
class RewardConfig:  # the score of a response: a function, a reward model or a server, then shaping (docs/rewards.md)
    # module:function or path/to/file.py:function; null: no function (a reward model or server scores)
    fn: Optional[str] = field(default="ppo_trainer.rewards.math:score", metadata=FUNCTION)
    batched: bool = False  # one call per batch: verl's batch reward manager, OpenRLHF's reward_func
    # mode, format_score and correct_score are passed to a function that names them when set to other
    # than the default. The math function's scoring: strict ("#### N") or flexible (the last number)
    mode: str = field(default="strict", metadata=choice("strict", "flexible"))
    format_score: float = 0.0  # score for a well-formed but wrong answer
    correct_score: float = 1.0  # also validation's threshold when the function returns no "acc"
    # a call that fails, times out or returns a non-number: raise, or score 0 and count it
    on_error: str = field(default="raise", metadata=choice("raise", "zero"))
    num_workers: int = field(default=0, metadata=at_least(0))  # processes that score rows concurrently; 0: in the driver
    # bounds each call of a reward function (needs num_workers >= 1); None: unbounded. Servers: remote.timeout_s
    timeout_s: Optional[float] = field(default=None, metadata=above(0, null="for no bound"))
    # subtracted from the training score of a response cut at max_new_tokens
    truncation_penalty: float = field(default=0.0, metadata=at_least(0))
    # DAPO: the last tokens of max_new_tokens where a penalty rises to overlong_penalty
    overlong_buffer: int = field(default=0, metadata=at_least(0))
    overlong_penalty: float = field(default=1.0, metadata=above(0))  # DAPO's penalty factor
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class EvalConfig:  # validation during training and ppo-eval
    # evaluate the first N rows of each data_source only; None: every row
    limit: Optional[int] = field(default=None, metadata=at_least(1, null="for every row"))
    max_new_tokens: int = field(default=256, metadata=at_least(1))  # the longest validation response, in tokens
    batch_size: int = field(default=64, metadata=at_least(1))  # prompts per engine call (x n samples)
    n: int = field(default=1, metadata=at_least(1))  # samples per prompt: accuracy is mean@n, with pass@n beside it
    # 0: greedy; None: greedy for n=1, else sampler.temperature
    temperature: Optional[float] = field(default=None, metadata=at_least(
        0, why="0: greedy", null="for greedy at eval.n=1 and sampler.temperature above"))
    save_generations: bool = True  # validation in training writes <output_dir>/val_generations/step_N.jsonl
    # ppo-eval's responses; default: a checkpoint's in <run>/eval/global_step_N.jsonl, another model's in ./eval.jsonl
    output_file: Optional[str] = None
    # the function that decides validation accuracy; null: reward.fn
    reward_fn: Optional[str] = field(default=None, metadata=FUNCTION)


@dataclass
class TrainerConfig:  # the run: steps, cadences, checkpoints, resume, logging
    # names the run's folders (outputs/<name>) and metrics
    experiment_name: str = field(default="default", metadata=matching(
        r"[\w.-]+", "letters, digits, '.', '_' and '-' only", why="it names folders: outputs/<name>"))
    output_dir: str = "outputs/${trainer.experiment_name}"  # the run's folder; fixed, so rerunning resumes
    # PPO steps (each: rollouts of data.train_batch_size prompts, then the updates)
    total_steps: int = field(default=100, metadata=at_least(1))
    seed: int = 0  # seeds sampling, shuffling and initial weights
    dry_run: bool = False  # print the plan (placement, batch sizes, memory) and the environment checks, then exit
    # validation every N steps; 0 validates only before the first and after the last step
    val_every: int = field(default=10, metadata=at_least(0))
    save_every: int = field(default=10, metadata=at_least(0))  # a checkpoint every N steps; 0 saves only at the end
    keep_last: int = field(default=2, metadata=at_least(1))  # checkpoints kept; older ones are removed
    # auto | never (the previous run is moved aside) | a checkpoint: its global_step_N folder, a
    # checkpoints/latest or checkpoints/best pointer (the step it names), or a run folder (its latest)
    resume: str = "auto"
    resume_allow: list[str] = field(default_factory=list)  # refused resume changes accepted knowingly (resume.py)
    # end this invocation early (total_steps unchanged); None: run to total_steps
    stop_after_steps: Optional[int] = field(default=None, metadata=at_least(1, null="to run to trainer.total_steps"))
    # the loggers, each when installed
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"], metadata=choice(*LOGGERS))
    log_samples: int = field(default=4, metadata=at_least(0))  # samples per step written to samples.jsonl
    max_skipped_steps: int = field(default=3, metadata=at_least(1))  # consecutive non-finite updates before the run stops
    # a worker call (a build, a phase, a save) running longer stops the run
    worker_timeout_s: float = field(default=3600.0, metadata=above(0))
    # Ray: a rank waiting longer for its group's peers fails
    collective_timeout_s: float = field(default=600.0, metadata=above(0))
    objective: str = "val/accuracy"  # metric returned to Hydra sweepers; checkpoints/best follows it
    # which objective value is best
    objective_direction: str = field(default="maximize", metadata=choice("maximize", "minimize"))
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


def schema_rules(schema: type = PPOConfig, prefix: str = "") -> dict[str, tuple[Rule, Any]]:
    """Every dotted key whose field carries a `Rule`, mapped to (the rule, the field's type hint)."""
    hints = get_type_hints(schema)
    rules: dict[str, tuple[Rule, Any]] = {}
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            rules.update(schema_rules(hints[f.name], prefix=f"{prefix}{f.name}."))
        elif "rule" in f.metadata:
            rules[prefix + f.name] = (f.metadata["rule"], hints[f.name])
    return rules


# Keys that have moved, old -> new: the critic's optimizer settings went into critic.optim (verl's
# spelling, like the actor's model.optim). An old key on the command line or in a sweep file is
# refused naming its new place (overrides.unknown_key_error); a saved config is read with the keys at
# their new places (composition.load_saved), so an older run folder resumes and evaluates.
MOVED_KEYS = {f"critic.{f.name}": f"critic.optim.{f.name}" for f in fields(OptimConfig)}
# Keys added since older runs saved their configs, with the value those runs trained with: a saved config
# without one is read with it (composition.load_saved), so that a resume sees no change where there was none
# (a run from before algorithm.adv_estimator trained GAE with its critic, one from before critic.lora a full critic).
ADDED_KEYS = {"algorithm.adv_estimator": "gae", "critic.lora": asdict(LoraConfig())}


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


RM_EXPERIMENT_GROUP = "rm_experiment"  # ppo-train-rm's experiments (config/rm_schema.py), not ppo-train's


def config_groups() -> list[str]:
    """ppo-train's config groups (folders of configs/): the schema's sections, experiment and sweep."""
    return sorted(p.name for p in CONFIG_DIR.iterdir()
                  if p.is_dir() and not p.name.startswith("_") and p.name != RM_EXPERIMENT_GROUP)
