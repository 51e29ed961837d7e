"""AdamW and its learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ppo_trainer.config.schema import OptimConfig


def build_optimizer(module: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable (sharded) parameters of `module`; weight decay on matrices only.
    Fused on CPU and CUDA (known to work with FSDP2's DTensors), elsewhere the default."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    groups = [{**g, "weight_decay": group_weight_decay(g, cfg)} for g in groups if g["params"]]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(float(cfg.betas[0]), float(cfg.betas[1])),
        eps=cfg.eps,
        fused=True if device.type in ("cpu", "cuda") else None,
    )


def group_weight_decay(group: dict, cfg: OptimConfig) -> float:
    """`cfg.weight_decay` for a parameter group of matrices, 0 for biases and norms."""
    return cfg.weight_decay if all(p.ndim >= 2 for p in group["params"]) else 0.0


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int | None, min_lr_ratio: float) -> float:
    """Base-LR multiplier of 0-based optimizer step `step`: warm-up (step + 1) / warmup_steps (the
    first step already moves), then 1, or a cosine down to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR of `lr_factor`, stepped after each optimizer step."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown learning-rate schedule {cfg.schedule!r}; expected constant or cosine")
    if cfg.schedule == "cosine" and total_steps is None:
        raise ValueError("schedule=cosine needs the total number of optimizer steps (total_steps)")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, cfg.warmup_steps, cfg.schedule, total_steps, cfg.min_lr_ratio),
    )


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                          cfg: OptimConfig) -> None:
    """Set `cfg`'s learning rate, betas, eps and weight decay on a restored optimizer and its schedule
    (a loaded state brings the saved ones): a resume trains with the config's values, at the
    schedule's restored step. The schedule's shape is `cfg`'s already (`build_scheduler`)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr, lr=cfg.lr * factor, betas=(float(cfg.betas[0]), float(cfg.betas[1])),
                     eps=cfg.eps, weight_decay=group_weight_decay(group, cfg))
