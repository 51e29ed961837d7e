"""The dry run's memory plan: GiB per role and device (weights, gradients, optimizer state,
activations of a micro-batch, the logits chunk, the rollout engine's weights and KV cache, the
reward model's weights) from the models' dimensions, before anything loads, with a warning naming
the keys to change when a device would not hold it. Estimates: docs/performance.md compares them
with measured peaks. Imports no torch (the dry run answers in seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ppo_trainer.config.derived import response_budget, uses_critic

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Dims:
    """A decoder-only transformer's shape (the keys of a transformers config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embedding matrix
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.embedding_params + self.layers * self.layer_params + self.hidden

    def projection(self, name: str) -> tuple[int, int]:
        """(in, out) features of a decoder layer's linear `name` (Llama/Qwen names; others: hidden, hidden)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}.get(name, (h, h))

    def activation_elements(self, attention_keys: int) -> int:
        """Elements one token keeps for the backward in one layer: the norms' inputs and outputs,
        q, k and v, the attention output and its projection, the MLP's gate, up, activation,
        product and output; `attention_keys` > 0 adds the attention scores and probabilities of
        an attention that materialises them (eager) over that many keys."""
        return (8 * self.hidden + 4 * self.intermediate + 2 * self.kv_heads * self.head_dim
                + 2 * self.heads * attention_keys)


# The shipped model options whose config.json may not be on this machine.
KNOWN_DIMS = {
    "Qwen/Qwen2.5-0.5B-Instruct": Dims(896, 24, 14, 2, 64, 4864, 151936, tied=True, qkv_bias=True),
    "embedded:smollm2-135m-instruct": Dims(576, 30, 9, 3, 64, 1536, 49152, tied=True),
}


def dims_from_config(config: dict[str, Any]) -> Dims:
    heads = config["num_attention_heads"]
    return Dims(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")))


def model_dims(path: str, part: Optional[str] = None) -> Dims | str:
    """The dimensions of `path` (a model.path value) from its config.json where it is on disk, else
    `KNOWN_DIMS`; else why they are unknown. Builds and downloads nothing."""
    from ppo_trainer.models import tiny
    from ppo_trainer.models.loading import ModelPathError, local_config

    if path.startswith("random:"):
        return dims_from_config({**tiny.TINY_ARCHITECTURE, "vocab_size": len(tiny.SPECIAL_TOKENS + tuple(tiny.CHARACTERS))})
    try:
        config = local_config(path, part)
    except ModelPathError as e:  # not to be had here (offline, say): the shipped options' dimensions still are
        return KNOWN_DIMS.get(path) or str(e)
    if config is not None:
        try:
            return dims_from_config(config)
        except KeyError as e:
            return f"its config.json has no {e} (not a decoder-only transformer this plan knows)"
    return KNOWN_DIMS.get(path) or "its config.json is not on this machine (a hub model not downloaded yet)"


@dataclass
class Line:
    """One role's share of one device, in bytes by component."""

    role: str
    parts: dict[str, float]
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def text(self) -> str:
        parts = " + ".join(f"{name} {gib(v)}" for name, v in self.parts.items() if v)
        return f"  {self.role:12s} {gib(self.total)} GiB = {parts}" + (f" ({self.note})" if self.note else "")


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def compute_bytes(cfg: Any, key: str) -> int:
    """Bytes per element of a role's compute dtype (`auto` as the device resolves it)."""
    from ppo_trainer.dtypes import resolve_dtype
    from ppo_trainer.workers.accelerators import detect

    return DTYPE_BYTES[resolve_dtype(cfg[key].dtype, detect(cfg.devices.accelerator).torch_device_type)]


def activation_bytes(dims: Dims, tokens: int, sequence: int, dtype_bytes: int, checkpointing: bool,
                     attention: str) -> float:
    """A micro-batch of `tokens` tokens in rows of up to `sequence` tokens: every layer's activations,
    or with gradient checkpointing every layer's input plus one layer's activations."""
    keys = sequence if attention == "eager" else 0  # sdpa and flash attention keep no score matrix
    per_layer = tokens * dims.activation_elements(keys) * dtype_bytes
    if checkpointing:
        return dims.layers * tokens * dims.hidden * dtype_bytes + per_layer
    return dims.layers * per_layer


def trainable_params(role: str, lora: Any, dims: Dims) -> int:
    """The parameters a LoRA `role` trains: rank x (in + out) per adapted projection of each layer, and the
    critic's value head (hidden + 1), always trained in full."""
    adapter = dims.layers * sum(lora.rank * sum(dims.projection(m)) for m in lora.target_modules)
    return adapter + (dims.hidden + 1 if role == "critic" else 0)


def trainer_line(role: str, cfg: Any, dims: Dims, ranks: int) -> Line:
    """The actor's or critic's share of one of its `ranks` devices (FSDP shards the states): with LoRA
    the frozen base in the compute dtype, and float32 weights, gradients and AdamW moments of what it trains."""
    side = cfg.model if role == "actor" else cfg.critic
    b = compute_bytes(cfg, "model" if role == "actor" else "critic")
    a = cfg.algorithm
    sequence = cfg.data.max_prompt_length + cfg.sampler.n * response_budget(cfg.sampler)  # a packed row at most
    activations = activation_bytes(dims, a.ppo_micro_batch_tokens, sequence, b, side.gradient_checkpointing,
                                   cfg.model.attn_implementation)
    gathered = b * (dims.embedding_params + dims.layer_params)  # FSDP: the root and one layer unsharded at a time
    if side.lora.rank:
        trained = trainable_params(role, side.lora, dims)
        parts = {"weights": b * dims.params / ranks + 4 * trained, "gradients": 4 * trained, "optimizer": 8 * trained}
    else:
        parts = {"weights": 4 * dims.params / ranks, "gradients": 4 * dims.params / ranks,
                 "optimizer": 8 * dims.params / ranks}
    parts["gathered"] = gathered
    parts["activations"] = activations
    if role == "actor":
        parts["logits chunk"] = 2 * 4 * cfg.model.logprob_chunk_tokens * dims.vocab  # float32 logits and softmax
    other = activation_bytes(dims, a.ppo_micro_batch_tokens, sequence, b, not side.gradient_checkpointing,
                             cfg.model.attn_implementation)
    note = (f"a {a.ppo_micro_batch_tokens}-token micro-batch; {gib(other)} GiB of activations "
            f"{'without' if side.gradient_checkpointing else 'with'} gradient checkpointing")
    return Line(role, parts, note)


# Measured (docs/performance.md): vLLM's CPU build keeps the weights twice (as loaded and repacked
# for its kernels) and ~0.3 GiB of runtime; on a GPU we assume 0.5 GiB of workspace and graphs.
VLLM_RUNTIME = {"cpu": 0.3 * GIB, "gpu": 0.5 * GIB}
PROCESS_BASELINE = 0.6 * GIB  # python, torch, tokenizers and the prompts of a CPU run's one process
# What the allocator holds beyond the live bytes the lines count, as a share of them. Measured on a CPU
# (docs/performance.md, "The memory plan against measured peaks"): the peak resident set was 22% and 19%
# above the plan with the process baseline, the heap's free blocks between live ones; 25% covers both.
MEMORY_MARGIN = 0.25


def rollout_line(cfg: Any, dims: Dims, device_bytes: Optional[float]) -> Line:
    """One device of a rollout replica: its weights in the compute dtype, its KV cache and runtime; with
    tensor parallelism k, one shard: 1/k of the weights, of the attention heads' KV (a KV head whole
    where there are fewer than k: vLLM copies them) and of the KV cache."""
    b = compute_bytes(cfg, "model")
    s, v = cfg.sampler, cfg.sampler.vllm
    tp = v.tensor_parallel_size if s.name == "vllm" else 1
    on_cpu = cfg.devices.accelerator == "cpu"
    weights = b * dims.params / tp * (2 if s.name == "vllm" and on_cpu else 1)
    per_token = 2 * dims.layers * max(dims.kv_heads / tp, 1) * dims.head_dim * b
    sequence = cfg.data.max_prompt_length + max(response_budget(s), response_budget(s, cfg.eval.max_new_tokens))
    sequences = s.generate_batch_size if s.name == "hf" else cfg.data.train_batch_size * s.n
    needed = per_token * sequence * sequences
    if s.name == "hf":
        return Line("rollout", {"weights": weights, "KV cache": needed}, f"HF generate, {sequences} sequences a call")
    if v.kv_cache_gb is not None or on_cpu:
        kv = (v.kv_cache_gb or 1.0) * GIB
    elif device_bytes is not None:
        kv = max(0.0, (v.gpu_memory_utilization or 0.5) * device_bytes - weights)
    else:
        kv = needed
    note = f"a step's {sequences} sequences of up to {sequence} tokens need {gib(needed)} GiB of KV cache"
    if tp > 1:
        note = (f"one of a replica's {tp} shards (sampler.vllm.tensor_parallel_size): 1/{tp} of the weights and of "
                f"the KV heads; {note} per shard")
    if on_cpu:
        note += "; weights twice: as loaded and repacked for the CPU kernels"
    return Line("rollout", {"weights": weights, "KV cache": kv, "runtime": VLLM_RUNTIME["cpu" if on_cpu else "gpu"]},
                note)


def device_memory(cfg: Any) -> tuple[Optional[float], str]:
    """(bytes, description) of one device of the run's kind as this machine sees it, or (None, why)."""
    from ppo_trainer.workers.accelerators import detect

    kind = detect(cfg.devices.accelerator).torch_device_type
    if kind == "cpu":
        total = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:")), None) if Path("/proc/meminfo").is_file() else None
        return (float(total), "this machine's memory") if total else (None, "this machine's memory is unknown")
    import torch

    if kind == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    return None, f"no {kind} device is visible here"


def memory_plan(cfg: Any, uses_reference: bool) -> list[str]:
    """The dry run's `# memory plan` section: one line per role on its device, then the total per
    device built from them line by line (`total_lines`), and a WARNING naming the keys to change when
    it exceeds the device's memory."""
    actor_dims = model_dims(cfg.model.path)
    critic_dims = model_dims(cfg.critic.path, "critic") if cfg.critic.path else actor_dims
    lines = ["", "# memory plan (GiB per device, estimated from the models' dimensions before anything loads)"]
    unknown = [(name, d) for name, d in (("model.path", actor_dims), ("critic.path", critic_dims)) if isinstance(d, str)]
    if unknown:
        return lines + [f"  unknown: {name}: {why}" for name, why in unknown]
    device_bytes, device_name = device_memory(cfg)
    dev = cfg.devices
    roles = [trainer_line("actor", cfg, actor_dims, dev.actor.num_devices)]
    if uses_reference and not cfg.model.lora.rank:
        roles.append(Line("reference", {"weights": compute_bytes(cfg, "model") * actor_dims.params
                                        / dev.actor.num_devices}, "a frozen copy"))
    if uses_critic(cfg):  # a critic-free algorithm.adv_estimator builds none
        roles.append(trainer_line("critic", cfg, critic_dims, dev.critic.num_devices))
    roles.append(rollout_line(cfg, actor_dims, device_bytes))
    reward_path = _reward_model_path(cfg)
    if reward_path:
        reward_dims = model_dims(reward_path)
        roles.append(Line("reward model", {"weights": compute_bytes(cfg, "model") * reward_dims.params})
                     if isinstance(reward_dims, Dims) else Line("reward model", {}, f"unknown: {reward_dims}"))
    lines += [line.text() for line in roles]
    totals, total_text = total_lines(roles, cfg)
    lines += total_text
    if device_bytes is None:
        lines.append(f"  device memory: {device_name}; the totals above are what each device must hold")
        return lines
    lines.append(f"  device memory: {gib(device_bytes)} GiB ({device_name})")
    over = [name for name, total in totals.items() if total > device_bytes]
    if over:
        lines.append(f"WARNING: {', '.join(over)} would need more than the device's {gib(device_bytes)} GiB: lower "
                     "algorithm.ppo_micro_batch_tokens, set model.gradient_checkpointing=true and "
                     "critic.gradient_checkpointing=true, lower sampler.vllm.kv_cache_gb, use LoRA (model.lora.rank, "
                     "critic.lora.rank), or spread the roles over more devices (devices.*.num_devices"
                     + (", sampler.vllm.tensor_parallel_size for the rollout's shards" if "rollout" in over else "")
                     + ")")
    return lines


TRANSIENT = ("gradients", "gathered", "activations", "logits chunk")  # live only while that role computes


def total_lines(roles: list[Line], cfg: Any) -> tuple[dict[str, float], list[str]]:
    """({device: bytes}, the lines that build each total from the role lines above them). Every
    number printed is a sum of numbers printed before it: a shared device holds `roles`
    (`shared_device_peak`) + the process (`PROCESS_BASELINE`, the CPU's one process) + the
    margin (`MEMORY_MARGIN` of both); a role on devices of its own, its line + the margin."""
    dev = cfg.devices
    if dev.backend != "local" and not dev.colocate:
        totals = {r.role: r.total * (1 + MEMORY_MARGIN) for r in roles}
        return totals, ["  total        " + ", ".join(f"{r.role} {gib(r.total)} + {gib(r.total * MEMORY_MARGIN)} = "
                                                      f"{gib(totals[r.role])}" for r in roles)
                        + f" GiB per device: each role on its own devices, its line + a margin of {MEMORY_MARGIN:.0%} "
                          "(what the allocator holds beyond the live bytes; measured peaks: docs/performance.md)"]
    peak, built, how = shared_device_peak(roles, cfg)
    process = PROCESS_BASELINE if dev.accelerator == "cpu" else 0.0
    margin = (peak + process) * MEMORY_MARGIN
    total = peak + process + margin
    lines = [f"  roles        {gib(peak)} GiB = {built}: {how}"]
    if process:
        lines.append(f"  process      {gib(process)} GiB: python, torch, tokenizers and the prompts of the one process")
    lines += [f"  margin       {gib(margin)} GiB: {MEMORY_MARGIN:.0%} of the above, what the allocator holds beyond "
              "the live bytes (measured peaks: docs/performance.md)",
              f"  total        {gib(total)} GiB per device = roles {gib(peak)}"
              + (f" + process {gib(process)}" if process else "") + f" + margin {gib(margin)}"]
    return {"the shared device": total}, lines


def shared_device_peak(roles: list[Line], cfg: Any) -> tuple[float, str, str]:
    """(bytes, how they add up, why) of the roles on a device they all share: what stays (weights,
    optimizer state, the rollout engine) plus the largest phase's transient part; when vLLM sleeps
    while the trainers compute, the larger of the training phase and the rollout phase."""
    rollout = next(r for r in roles if r.role == "rollout")
    others = [r for r in roles if r is not rollout]
    resting = sum(v for r in others for k, v in r.parts.items() if k not in TRANSIENT)
    phases = {r.role: sum(r.parts.get(k, 0.0) for k in TRANSIENT) for r in others}
    busiest_role = max(phases, key=phases.get)
    busiest = phases[busiest_role]
    kept = f"what stays {gib(resting)} (weights, optimizer state)"
    phase = f"the {busiest_role}'s computing {gib(busiest)} ({', '.join(TRANSIENT)})"
    if cfg.sampler.name == "vllm" and cfg.devices.colocate and cfg.devices.accelerator != "cpu":
        return (resting + max(busiest, rollout.total), f"{kept} + the larger of {phase} and the rollout "
                f"{gib(rollout.total)}", "vLLM sleeps while actor and critic compute")
    beside = ("the trainers' phases one at a time, the rollout generating beside them (sampler.max_staleness)"
              if cfg.sampler.max_staleness else "one phase computing at a time")
    return (resting + busiest + rollout.total, f"{kept} + {phase} + the rollout {gib(rollout.total)}",
            f"one device holds every role, {beside}")


def _reward_model_path(cfg: Any) -> Optional[str]:
    model = getattr(cfg.reward, "model", None)
    return getattr(model, "path", None) if model is not None else None
