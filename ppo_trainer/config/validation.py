"""Static validation of a composed config: every field against its schema `Rule` (one loop), then
the rules that span keys (batch arithmetic, KL routing, reward combinations, lengths); no file or
device access, so a config error exits 2 before anything loads."""

from __future__ import annotations

import re
from typing import Any, Optional, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ppo_trainer.config import metric_names
from ppo_trainer.config.derived import (
    batch_arithmetic,
    is_multi_turn,
    kl_in_reward,
    trained_roles,
    uses_critic,
    uses_reference,
)
from ppo_trainer.config.overrides import check_key, unknown_key_error
from ppo_trainer.config.schema import (
    ARITHMETIC_OPERATIONS,
    ARITHMETIC_TWO_STEP,
    ConfigError,
    PPOConfig,
    RewardConfig,
    Rule,
    schema_rules,
)
from ppo_trainer.config.secrets import has_credentials, redact_url
from ppo_trainer.core.choices import FILTER_METRICS, GROUP_ESTIMATORS


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"'{key}' {message}")


def _accepts(rule: Rule, value: Any) -> bool:
    """Whether one value (a list field's element) is one the rule accepts."""
    if rule.allowed:
        return value in rule.allowed
    if rule.pattern:
        return isinstance(value, str) and re.fullmatch(rule.pattern, value) is not None
    if rule.op:
        return value >= rule.low if rule.op == ">=" else value > rule.low
    low, high = (float(x) for x in rule.interval[1:-1].split(","))
    return ((low < value if rule.interval[0] == "(" else low <= value)
            and (value < high if rule.interval[-1] == ")" else value <= high))


def field_problem(rule: Rule, value: Any, nullable: bool) -> Optional[str]:
    """What is wrong with a field's value, as the rest of its one-line error after the quoted key
    ("is 'x'; allowed values: a, b", "must be >= 0, got -1"); None when the rule accepts it."""
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, ListConfig)) else None
    if values is None and _accepts(rule, value):
        return None
    if values is not None and all(_accepts(rule, v) for v in values) and rule.length in (None, len(values)):
        return None
    why = f" ({rule.why})" if rule.why else ""
    null = f", or null {rule.null}".rstrip() if nullable else ""
    if rule.allowed or rule.pattern:
        bad = next((v for v in values if not _accepts(rule, v)), None) if values is not None else value
        verb = "has" if values is not None else "is"
        if rule.allowed and rule.why:  # a choice refused for a reason: the reason says what to do
            return f"{verb} {bad!r}, but {rule.why}"
        told = f"allowed values: {rule.describe()}" if rule.allowed else f"expected {rule.describe()}"
        return f"{verb} {bad!r}; {told}{why}{null}"
    if values is not None:
        count = f"be {rule.length} values" if rule.length else "all be"
        return f"must {count} {rule.describe()}{why}{null}, got {values}"
    return f"must be {rule.describe()}{why}{null}, got {value}"


def check_fields(cfg: DictConfig) -> None:
    """Every field that carries a `Rule` in the schema, checked against it: ConfigError naming the first
    key whose value the rule refuses."""
    for key, (rule, hint) in schema_rules().items():
        nullable = get_origin(hint) is Union and type(None) in get_args(hint)
        problem = field_problem(rule, OmegaConf.select(cfg, key), nullable)
        _require(problem is None, key, problem or "")


def validate_static(cfg: DictConfig) -> DictConfig:
    """The typed, resolved config; checks types, each field's rule, and the rules that span keys,
    without file or device access."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(PPOConfig), cfg)
        OmegaConf.resolve(cfg)
    except ConfigKeyError as e:  # a key the schema lacks, e.g. added with `+group.key`
        raise unknown_key_error(e.full_key) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"invalid value for '{key}': {str(e).splitlines()[0]}") from None
    check_fields(cfg)
    s, g, a, d, dev, t = cfg.sampler, cfg.gae, cfg.algorithm, cfg.data, cfg.devices, cfg.trainer

    _require(s.vllm.kv_cache_gb is None or s.vllm.gpu_memory_utilization is None, "sampler.vllm.kv_cache_gb",
             "and sampler.vllm.gpu_memory_utilization are both set: size vLLM's memory by one of them (kv_cache_gb: "
             "the KV cache in GiB; gpu_memory_utilization: a share of the GPU)")
    _require(cfg.reward.format_score < cfg.reward.correct_score, "reward.format_score",
             f"({cfg.reward.format_score}) must be below reward.correct_score ({cfg.reward.correct_score}): a "
             "well-formed wrong answer would count as correct")
    _require(g.advantage_std_scale or g.normalize_advantages, "gae.advantage_std_scale",
             "is false with gae.normalize_advantages=false: it only chooses how advantages are normalized; "
             "set gae.normalize_advantages=true to subtract the mean only, or leave gae.advantage_std_scale true")
    for side in ("model", "critic"):
        lora = cfg[side].lora
        _require(lora.rank == 0 or len(lora.target_modules) > 0, f"{side}.lora.target_modules",
                 f"must name at least one module with {side}.lora.rank={lora.rank}")
    eval_t = cfg.eval.temperature
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
    response = ("sampler.multi_turn's response budget (max_response_tokens, or max_turns x (sampler.max_new_tokens + "
                "max_observation_tokens))" if is_multi_turn(s) else "sampler.max_new_tokens")
    _require(s.vllm.max_model_len is None or s.vllm.max_model_len >= seq_tokens, "sampler.vllm.max_model_len",
             f"must be >= data.max_prompt_length + {response} = {seq_tokens}")
    _require(a.ppo_micro_batch_tokens >= seq_tokens, "algorithm.ppo_micro_batch_tokens",
             f"({a.ppo_micro_batch_tokens}) must hold one full sequence: >= data.max_prompt_length + "
             f"{response} = {seq_tokens}")
    mt = s.multi_turn
    _require(mt.max_response_tokens is None or mt.max_response_tokens >= s.max_new_tokens,
             "sampler.multi_turn.max_response_tokens",
             f"({mt.max_response_tokens}) must leave room for one full turn: >= sampler.max_new_tokens ({s.max_new_tokens})")
    _require(len(set(mt.tools)) == len(mt.tools), "sampler.multi_turn.tools", f"names a tool twice: {list(mt.tools)}")
    _require(not mt.tools or d.use_chat_template, "sampler.multi_turn.tools",
             "is set with data.use_chat_template=false: tools are offered and their results shown through the chat "
             "template; set data.use_chat_template=true, or use an environment (sampler.multi_turn.env) instead")
    _require(d.train_batch_size % a.ppo_mini_batch_size == 0, "algorithm.ppo_mini_batch_size",
             f"({a.ppo_mini_batch_size}) must divide data.train_batch_size ({d.train_batch_size})")
    for role in trained_roles(cfg):
        replicas = dev[role].num_devices
        _require(sizes["sequences_per_mini_batch"] >= replicas, f"devices.{role}.num_devices",
                 f"({replicas}) exceeds the sequences per mini-batch ({sizes['sequences_per_mini_batch']} = "
                 "algorithm.ppo_mini_batch_size x sampler.n): every replica needs at least one")

    _estimator_checks(cfg)

    if g.kl_ctrl == "adaptive":  # the controller multiplies the coefficient: from 0 it never moves
        _require(g.kl_coef > 0, "gae.kl_coef", "must be > 0 with gae.kl_ctrl=adaptive (the controller scales it)")
        _require(kl_in_reward(cfg), "gae.kl_ctrl",
                 "is adaptive, but the KL is not in the reward (algorithm.use_kl_loss=true moves it into the loss); "
                 "set algorithm.use_kl_in_reward=true or gae.kl_ctrl=fixed")
    _require(not (a.use_kl_in_reward and g.kl_coef == 0), "algorithm.use_kl_in_reward",
             "is true but gae.kl_coef=0 puts no KL in the reward; set gae.kl_coef > 0")
    _require(a.critic_warmup_explained_var is None or a.critic_warmup >= 1, "algorithm.critic_warmup_explained_var",
             "ends a critic warm-up, but algorithm.critic_warmup=0 runs none; set algorithm.critic_warmup to the most "
             "warm-up steps (e.g. 10), or remove algorithm.critic_warmup_explained_var")
    _require(a.positive_lm_loss_coef > 0 or a.positive_lm_examples == "correct", "algorithm.positive_lm_examples",
             "is set but algorithm.positive_lm_loss_coef=0 adds no positive-example loss; set the coefficient > 0")
    _require(not (a.positive_lm_loss_coef > 0 and a.positive_lm_examples == "group_best" and s.n < 2),
             "algorithm.positive_lm_examples", "is group_best with sampler.n=1: a prompt's only response is never "
             "above the rest of its group; set sampler.n >= 2, or positive_lm_examples=correct")
    _require(a.rollout_correction == "none" or a.recompute_old_logprobs, "algorithm.rollout_correction",
             f"is {a.rollout_correction!r} but algorithm.recompute_old_logprobs=false: with the sampler's "
             "logprobs as the old ones every weight pi_old / pi_rollout is 1; set one of them back")

    _require(len(set(d.train_files)) == len(d.train_files), "data.train_files",
             "names a file twice; list each once and weight it with data.train_weights")
    _require(not d.train_weights or len(d.train_weights) == len(d.train_files), "data.train_weights",
             f"has {len(d.train_weights)} weights for {len(d.train_files)} data.train_files; give one per file, "
             "or none to weight the files by their size")
    _require(d.system_prompt is None or d.use_chat_template, "data.system_prompt",
             "is set but data.use_chat_template=false has no system turn; remove it or use the chat template")
    _require(not d.chat_template_kwargs or d.use_chat_template, "data.chat_template_kwargs",
             "is set but data.use_chat_template=false renders no template; remove it or use the chat template")
    if d.source == "digits":
        _require(1 <= d.digits.min_length <= d.digits.length, "data.digits.min_length",
                 f"({d.digits.min_length}) must be in [1, data.digits.length={d.digits.length}]")
        answer_tokens = d.digits.length if d.digits.task == "reverse" else 1
        _require(s.max_new_tokens >= answer_tokens, "sampler.max_new_tokens",
                 f"({s.max_new_tokens}) is too short for the longest data.digits answer ({answer_tokens} tokens)")
    if d.source == "arithmetic":
        _arithmetic_checks(d.arithmetic)
    _reward_checks(cfg)
    _staleness_checks(cfg)
    _filter_checks(cfg)
    _tensor_parallel_checks(cfg)

    if dev.backend == "local":
        for role in (*trained_roles(cfg), "rollout", "reward_model"):
            _require(dev[role].num_devices == 1, f"devices.{role}.num_devices",
                     f"is {dev[role].num_devices}, but devices.backend=local runs one process on one device; "
                     "use devices.backend=ray for more")
    return cfg


def url_credentials_error(url: str) -> ConfigError:
    """The error for credentials in reward.remote.url: the client cannot send them (urllib takes the
    userinfo for part of the host name), and the URL is printed and saved; the token goes elsewhere."""
    return ConfigError(f"reward.remote.url={redact_url(url)} holds credentials (user:password@), which the client "
                       "does not send and which would show wherever the URL is printed or saved; remove them and "
                       "give the server's token with reward.remote.token=... or $PPO_REWARD_TOKEN (sent as "
                       "'Authorization: Bearer <token>')")


def _estimator_checks(cfg: DictConfig) -> None:
    """algorithm.adv_estimator against the keys it needs or makes meaningless: groups of samples
    for grpo and rloo; no critic to start from a path, adapt or warm up for a critic-free one."""
    a, estimator = cfg.algorithm, cfg.algorithm.adv_estimator
    _require(estimator not in GROUP_ESTIMATORS or cfg.sampler.n >= 2, "sampler.n",
             f"is {cfg.sampler.n}, but algorithm.adv_estimator={estimator} compares each sample with the other "
             "samples of its prompt; set sampler.n >= 2, or algorithm.adv_estimator=gae or reinforce_plus_plus")
    if uses_critic(cfg):
        return
    _require(a.critic_warmup == 0, "algorithm.critic_warmup",
             f"is {a.critic_warmup}, but algorithm.adv_estimator={estimator} is critic-free: there is no critic to "
             "warm up; set algorithm.critic_warmup=0, or algorithm.adv_estimator=gae")
    _require(cfg.critic.path is None, "critic.path",
             f"is set, but algorithm.adv_estimator={estimator} is critic-free and builds no critic; remove "
             "critic.path, or set algorithm.adv_estimator=gae")
    _require(cfg.critic.lora.rank == 0, "critic.lora.rank",
             f"is {cfg.critic.lora.rank}, but algorithm.adv_estimator={estimator} is critic-free and builds no critic; "
             "set critic.lora.rank=0, or algorithm.adv_estimator=gae")


def _staleness_checks(cfg: DictConfig) -> None:
    """sampler.max_staleness and sampler.partial_rollouts (asynchronous rollouts, docs/async.md): what a
    lagged policy needs, and what partial rollouts need besides."""
    s, dev, k = cfg.sampler, cfg.devices, cfg.sampler.max_staleness
    if s.partial_rollouts:
        _require(s.name == "vllm", "sampler.partial_rollouts",
                 f"is true with sampler={s.name}: only vLLM can carry a sample across a weight sync; set "
                 "sampler=vllm, or sampler.partial_rollouts=false")
        _require(k >= 1, "sampler.partial_rollouts",
                 "is true with sampler.max_staleness=0: lock-step rollouts never meet a weight sync mid-sample; set "
                 "sampler.max_staleness >= 1, or sampler.partial_rollouts=false")
        _require(s.multi_turn.env is None, "sampler.partial_rollouts",
                 "is true with sampler.multi_turn.env: an environment's episode cannot continue under other "
                 "weights; set sampler.partial_rollouts=false (whole episodes work with sampler.max_staleness)")
    if k == 0:
        return
    _require(cfg.algorithm.recompute_old_logprobs, "sampler.max_staleness",
             f"is {k} with algorithm.recompute_old_logprobs=false: PPO's ratio is against the policy being "
             "updated, not the older one that sampled; set algorithm.recompute_old_logprobs=true, or "
             "sampler.max_staleness=0")
    _require(cfg.algorithm.rollout_correction != "none", "sampler.max_staleness",
             f"is {k} with algorithm.rollout_correction=none: samples from an older policy need the importance "
             "weight against it (docs/async.md); set algorithm.rollout_correction=tis (or mis), or "
             "sampler.max_staleness=0")
    _require(dev.backend == "ray", "sampler.max_staleness",
             f"is {k} with devices.backend=local: one process cannot generate while it trains; set "
             "devices.backend=ray, or sampler.max_staleness=0")
    _require(not (dev.colocate and dev.accelerator != "cpu"), "sampler.max_staleness",
             f"is {k} with devices.colocate=true on devices.accelerator={dev.accelerator}: on GPUs and NPUs vLLM "
             "sleeps while the trainers use the shared devices, so nothing overlaps; set devices.colocate=false "
             "(or devices.accelerator=cpu), or sampler.max_staleness=0")


def _tensor_parallel_checks(cfg: DictConfig) -> None:
    """sampler.vllm.tensor_parallel_size k > 1: vLLM on Ray, separate pools, num_devices / k replicas of k
    devices, each on one node."""
    k, dev = cfg.sampler.vllm.tensor_parallel_size, cfg.devices
    if k == 1:
        return
    key = "sampler.vllm.tensor_parallel_size"
    _require(cfg.sampler.name == "vllm", key, f"is {k} with sampler={cfg.sampler.name}: only a vLLM engine spans "
             "several devices; set sampler=vllm, or 1")
    _require(dev.backend == "ray", key, f"is {k} with devices.backend=local, which runs one process on one device; "
             "set devices.backend=ray (docs/cluster.md), or 1")
    _require(not dev.colocate, key, f"is {k} with devices.colocate=true: colocated roles share one device per rank, "
             "and a rollout engine on several of them is not built; set devices.colocate=false (the rollout gets "
             "devices of its own), or 1")
    _require(dev.rollout.num_devices % k == 0, "devices.rollout.num_devices",
             f"({dev.rollout.num_devices}) must be a multiple of {key} ({k}): each rollout replica is one vLLM "
             f"engine on {k} devices")
    _require(k <= dev.devices_per_node, key,
             f"({k}) exceeds devices.devices_per_node ({dev.devices_per_node}): a rollout replica's devices are on "
             "one node (an engine spanning nodes is not built)")


def _filter_checks(cfg: DictConfig) -> None:
    """algorithm.filter_groups: groups to compare, lock-step draws, and a metric this trainer has (verl's
    seq_reward and seq_final_reward are its token-level sums, which the trainer does not build)."""
    a = cfg.algorithm
    _require(a.filter_groups_metric in FILTER_METRICS, "algorithm.filter_groups_metric",
             f"is {a.filter_groups_metric!r}; this trainer filters on {' or '.join(FILTER_METRICS)} (score: the "
             "shaped score it trains on, verl's seq_reward and seq_final_reward without a KL in the reward; acc: "
             "score >= reward.correct_score)")
    if not a.filter_groups:
        return
    _require(cfg.sampler.n >= 2, "algorithm.filter_groups",
             f"is true with sampler.n={cfg.sampler.n}: a group of one sample has no spread; set sampler.n >= 2, "
             "or algorithm.filter_groups=false")
    _require(cfg.sampler.max_staleness == 0, "algorithm.filter_groups",
             f"is true with sampler.max_staleness={cfg.sampler.max_staleness}: extra draws generate within the "
             "step, which the rollouts generated ahead cannot; set sampler.max_staleness=0, or "
             "algorithm.filter_groups=false")


def _arithmetic_checks(ar: DictConfig) -> None:
    """Training operations that can make the problems asked for: at least one, and a two-step form
    (ARITHMETIC_TWO_STEP) among them when two_step_fraction > 0."""
    ops = list(ar.operations)
    _require(bool(ops), "data.arithmetic.operations",
             f"is empty; list at least one of {', '.join(ARITHMETIC_OPERATIONS)}")
    forms = ", ".join(f"{form[0]} then {form[1]}" for form in ARITHMETIC_TWO_STEP)
    _require(ar.two_step_fraction == 0 or any(set(form) <= set(ops) for form in ARITHMETIC_TWO_STEP),
             "data.arithmetic.two_step_fraction", f"is {ar.two_step_fraction}, but data.arithmetic.operations "
             f"[{', '.join(ops)}] make no two-step problem ({forms}); add the operations of one, or set "
             "data.arithmetic.two_step_fraction=0")


def _reward_checks(cfg: DictConfig) -> None:
    """reward.*: what scores, the pool, the shaping (docs/rewards.md). A function's signature is
    checked where it is imported (rewards/loader.py), before any model loads."""
    r = cfg.reward
    _require(r.fn is not None or r.model.path or r.remote.url or cfg.sampler.multi_turn.env, "reward.fn",
             "is null and neither reward.model.path, reward.remote.url nor sampler.multi_turn.env (whose rewards "
             "count) is set: nothing would score the responses")
    if r.remote.url and has_credentials(r.remote.url):
        raise url_credentials_error(r.remote.url)
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
