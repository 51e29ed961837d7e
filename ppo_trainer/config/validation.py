"""Static validation of a composed config: types, allowed values, ranges, keys that must agree,
batch arithmetic; no file or device access, so a config error exits 2 before anything loads."""

from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ppo_trainer.config import metric_names
from ppo_trainer.config.derived import batch_arithmetic
from ppo_trainer.config.schema import ConfigError, PPOConfig, RewardConfig
from ppo_trainer.core import choices
from ppo_trainer.config.derived import kl_in_reward, uses_reference
from ppo_trainer.config.overrides import check_key, unknown_key_error
from ppo_trainer.config.secrets import has_credentials, redact_url


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
                 "critic.eps", "gae.adaptive_alpha", "gae.kl_target", "gae.kl_horizon")
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
    _in_interval(cfg, "[0, 1]", "model.optim.min_lr_ratio", "critic.min_lr_ratio", "gae.gamma", "gae.lam", "data.arithmetic.two_step_fraction")
    _in_interval(cfg, "(0, 1]", "sampler.top_p")
    _in_interval(cfg, "(0, 1)", "algorithm.clip_ratio_low", "algorithm.clip_ratio_high")
    _require(g.critic_lam is None or 0 <= g.critic_lam <= 1, "gae.critic_lam",
             f"must be in [0, 1], or null for gae.lam, got {g.critic_lam}")
    _require(g.advantage_std_scale or g.normalize_advantages, "gae.advantage_std_scale",
             "is false with gae.normalize_advantages=false: it only chooses how advantages are normalized; "
             "set gae.normalize_advantages=true to subtract the mean only, or leave gae.advantage_std_scale true")
    _require(s.temperature > 0, "sampler.temperature", "must be > 0 (training samples; greedy is for eval)")
    for key in ("model.optim.betas", "critic.betas"):
        betas = OmegaConf.select(cfg, key)
        _require(len(betas) == 2 and all(0 <= b < 1 for b in betas), key, f"must be two numbers in [0, 1), got {list(betas)}")
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


def url_credentials_error(url: str) -> ConfigError:
    """The error for credentials in reward.remote.url: the client cannot send them (urllib takes the
    userinfo for part of the host name), and the URL is printed and saved; the token goes elsewhere."""
    return ConfigError(f"reward.remote.url={redact_url(url)} holds credentials (user:password@), which the client "
                       "does not send and which would show wherever the URL is printed or saved; remove them and "
                       "give the server's token with reward.remote.token=... or $PPO_REWARD_TOKEN (sent as "
                       "'Authorization: Bearer <token>')")


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
    if r.remote.url and has_credentials(r.remote.url):
        raise url_credentials_error(r.remote.url)
    for part in ("model", "remote"):
        _require(r[part].clip is None or r[part].clip > 0, f"reward.{part}.clip", f"must be > 0, or null, got {r[part].clip}")
    _lower_bound(cfg, ">=", 1, "reward.remote.batch_size", "reward.remote.concurrency")
    _lower_bound(cfg, ">=", 0, "reward.remote.retries")
    _lower_bound(cfg, ">", 0, "reward.remote.timeout_s")
    _lower_bound(cfg, ">=", 0, "reward.num_workers", "reward.truncation_penalty", "reward.overlong_buffer")
    _lower_bound(cfg, ">", 0, "reward.overlong_penalty")
    _require(r.timeout_s is None or r.timeout_s > 0, "reward.timeout_s", f"must be > 0, or null for no bound, got "
             f"{r.timeout_s}")
    _require(r.timeout_s is None or r.fn is not None or cfg.eval.reward_fn is not None, "reward.timeout_s",
             "bounds reward functions only, and reward.fn and eval.reward_fn are null: nothing would use it; to bound "
             f"the reward server's requests, set reward.remote.timeout_s={r.timeout_s} instead")
    _require(r.timeout_s is None or r.num_workers >= 1, "reward.timeout_s",
             "needs reward.num_workers >= 1: a call in the driver cannot be stopped; set reward.num_workers=1 or more")
    _require(not (r.batched and r.num_workers > 1), "reward.num_workers",
             f"is {r.num_workers}, but a batched function (reward.batched=true) is called once per batch, on one "
             "worker; set reward.num_workers=1 (calls bounded by reward.timeout_s) or 0")
    _require(r.overlong_buffer < cfg.sampler.max_new_tokens, "reward.overlong_buffer",
             f"({r.overlong_buffer}) must be below sampler.max_new_tokens ({cfg.sampler.max_new_tokens})")
    _require(r.overlong_buffer > 0 or r.overlong_penalty == RewardConfig.overlong_penalty, "reward.overlong_penalty",
             "is set but reward.overlong_buffer=0 applies no overlong penalty; set reward.overlong_buffer (tokens)")
