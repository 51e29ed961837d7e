"""FSDP2 wrapping and `FSDPEngine`, shared by actor and critic. `train` takes the same full batch on every
rank, each rank its share of each mini-batch (`Batch.deal`); `forward_rows` takes each rank's own rows."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import OptimConfig
from ppo_trainer.dtypes import compute_dtype, resolve_dtype
from ppo_trainer.engine.distributed import all_reduce_sum, barrier, device_mesh, rank, resolve_device, world_size
from ppo_trainer.engine.microbatch import LossFn, accumulate_gradients, global_counts, plan_micro_batches
from ppo_trainer.engine.optim import apply_hyperparameters, build_optimizer, build_scheduler
from ppo_trainer.models.packing import Layout

ENGINE_STATE = "engine_state.json"


def shard_model(module: nn.Module, layers: Sequence[nn.Module], device: torch.device, dtype: torch.dtype,
                cpu_offload: bool = False, fp32_modules: Sequence[nn.Module] = ()) -> FSDPModule:
    """`fully_shard` each of `layers`, each of `fp32_modules` (computed in float32, e.g. a value head), then
    the root `module` (float32 master parameters), which it returns. Compute in `dtype`, reduction in float32."""
    mesh = device_mesh(device)
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else None
    mixed = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    # float32 parameters and inputs: a head inside a model's own forward (a classifier's score) gets bf16 states
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh} if offload is None else {"mesh": mesh, "offload_policy": offload}
    for layer in layers:
        fully_shard(layer, mp_policy=mixed, **kwargs)
    for head in fp32_modules:
        fully_shard(head, mp_policy=full, **kwargs)
    fully_shard(module, mp_policy=mixed, **kwargs)
    return module  # type: ignore[return-value]


def summarize_steps(history: list[dict[str, float]]) -> dict[str, float]:
    """One update's statistics from its optimizer steps: the count of `skipped_steps` (non-finite gradient
    norm), and the mean of every other key over the steps taken (NaN when all were skipped: stays visible)."""
    taken = [h for h in history if not h["skipped_steps"]]
    means = {key: sum(h[key] for h in taken) / len(taken) if taken else float("nan") for key in history[0]}
    return {**means, "skipped_steps": sum(h["skipped_steps"] for h in history)}


class FSDPEngine:
    """One FSDP2-sharded module (float32 parameters, sharded in place; `layers`: its repeated blocks),
    frozen unless given an `OptimConfig`. `dtype`: a compute dtype name or "auto" (resolved into
    `self.dtype`); `total_steps`: optimizer steps over the run (for the schedule)."""

    def __init__(self, module: nn.Module, layers: Sequence[nn.Module], device: str | torch.device, dtype: str,
                 cpu_offload: bool = False, optim: Optional[OptimConfig] = None, total_steps: Optional[int] = None,
                 fp32_modules: Sequence[nn.Module] = ()) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device.type)
        if optim is None:
            module.requires_grad_(False)
        self.module = shard_model(module, layers, self.device, compute_dtype(self.dtype), cpu_offload, fp32_modules)
        # how the module's forwards lay out rows (`models.packing`), which sets a micro-batch's cost
        self.layout = getattr(module, "layout", Layout())
        self.optim_cfg = optim
        self.optimizer = build_optimizer(module, optim, self.device) if optim is not None else None
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps) if optim is not None else None
        self.updates = 0  # calls of `train`, part of the resume state (it seeds the shuffling)
        self.rank, self.world_size = rank(), world_size()  # the group exists once the module is sharded

    def forward_rows(self, batch: Batch, budget: int, fn: Callable[[Batch], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """`fn(micro_batch_on_device)` over this rank's rows in eval mode, without gradients, each
        returned [b, t] reassembled into a CPU float32 [B, T] (0 beyond a micro-batch's trimmed width)."""
        outputs: list[torch.Tensor] = []
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for micro in plan_micro_batches(batch, budget, self.layout):
                    results = fn(micro.batch.to(self.device))
                    if micro.dummy:
                        continue
                    if not outputs:
                        outputs.extend(torch.zeros(len(batch), batch.response_length) for _ in results)
                    for out, res in zip(outputs, results):
                        out[micro.rows, : res.shape[1]] = res.detach().float().cpu()
        finally:
            self.module.reshard()  # the root keeps its parameters gathered after a forward
            self.module.train(was_training)
        return outputs

    def mini_batch_order(self, batch: Batch, algorithm: Any, seed: int, epoch: int) -> torch.Tensor:
        """[B] the row order of `train`'s mini-batches in `epoch` of its next call: prompts shuffled by
        (seed, previous `train` calls, epoch), the same on every rank and after a resume, a prompt's
        samples adjacent (a mini-batch holds whole groups whose prompt the forward computes once)."""
        if not algorithm.shuffle_mini_batches:
            return torch.arange(len(batch))
        groups = batch.prompt_groups()
        # a tuple of ints hashes the same in every process
        generator = torch.Generator().manual_seed(hash((seed, self.updates, epoch)) & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.tensor([row for g in torch.randperm(len(groups), generator=generator).tolist() for row in groups[g]])

    def train(self, batch: Batch, loss_fn: LossFn, mini_batch_size: int, algorithm: Any, seed: int,
              epochs: int) -> dict[str, float]:
        """`epochs` passes over `batch` (the role's: algorithm.ppo_epochs, critic.ppo_epochs) in
        mini-batches of `mini_batch_size` sequences (`mini_batch_order`), one optimizer step each.
        Returns `summarize_steps` of `loss_fn`'s statistics plus grad_norm and lr."""
        if self.optimizer is None:
            raise RuntimeError("this engine is frozen (built without an optimizer)")
        self.module.train()
        history: list[dict[str, float]] = []
        for epoch in range(epochs):
            order = self.mini_batch_order(batch, algorithm, seed, epoch)
            for start in range(0, len(batch), mini_batch_size):
                rows = order[start : start + mini_batch_size]
                stats = self.backward_mini_batch(batch.select(rows), loss_fn, algorithm.ppo_micro_batch_tokens)
                stats.update(self.optimizer_step())
                history.append(stats)
        self.updates += 1
        return summarize_steps(history)

    def backward_mini_batch(self, mini_batch: Batch, loss_fn: LossFn, budget: int) -> dict[str, float]:
        """Accumulate one mini-batch's gradient (`accumulate_gradients`) from this rank's share; its
        statistics, and `padding_share`: the share of the tokens its forwards computed that were padding."""
        if len(mini_batch) < self.world_size:
            raise ValueError(f"a mini-batch of {len(mini_batch)} sequences cannot feed {self.world_size} "
                             "data-parallel ranks; every rank needs at least one (raise "
                             "algorithm.ppo_mini_batch_size or use fewer devices)")
        local = mini_batch.select(mini_batch.deal(self.world_size)[self.rank])
        counts = global_counts(local)
        micro = [dataclasses.replace(m, batch=m.batch.to(self.device)) for m in plan_micro_batches(local, budget, self.layout)]
        stats = accumulate_gradients(micro, loss_fn, counts)
        padding, tokens = all_reduce_sum([float(sum(m.padding for m in micro if not m.dummy)),
                                          float(sum(m.tokens for m in micro if not m.dummy))]).tolist()
        return {**stats, "padding_share": padding / tokens}

    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients by global norm, step AdamW and the schedule; returns grad_norm, lr and
        skipped_steps: a non-finite norm skips the parameter update (the gradients are dropped)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": norm, "lr": float(lr), "skipped_steps": 0.0 if finite else 1.0}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All parameters and buffers, unsharded, float32, on CPU, on rank 0 (`{}` elsewhere)."""
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _resume_state(self, with_optim: bool) -> dict[str, Any]:
        """Trainable weights (and AdamW's state) as DCP state dicts; frozen ones reload from the model."""
        options = StateDictOptions(ignore_frozen_params=True)
        if not with_optim:
            return {"model": get_model_state_dict(self.module, options=options)}
        model_state, optim_state = get_state_dict(self.module, self.optimizer, options=options)
        return {"model": model_state, "optim": optim_state}

    def save_state(self, folder: str | Path) -> None:
        """Exact-resume state: DCP shards of `_resume_state` and engine_state.json (schedule, updates)."""
        if self.optimizer is None:
            raise RuntimeError("a frozen engine has no training state to save")
        folder = Path(folder)
        # before the first step AdamW has no state: asking DCP for it would initialise (advance) it
        has_optim_state = bool(self.optimizer.state)
        dcp.save(self._resume_state(has_optim_state), storage_writer=dcp.FileSystemWriter(str(folder), overwrite=True))
        if self.rank == 0:
            info = {"scheduler": self.scheduler.state_dict(), "updates": self.updates,
                    "has_optim_state": has_optim_state}
            (folder / ENGINE_STATE).write_text(json.dumps(info, indent=2) + "\n")
        barrier()

    def load_state(self, folder: str | Path) -> None:
        """Restore what `save_state` wrote (same model, world size may differ), then the config's
        optimizer values (`apply_hyperparameters`): a resume applies a changed lr, betas, eps or weight decay."""
        folder = Path(folder)
        if not (folder / ENGINE_STATE).is_file():
            raise FileNotFoundError(f"no engine state in '{folder}' (expected {ENGINE_STATE} and DCP shards)")
        info = json.loads((folder / ENGINE_STATE).read_text())
        state = self._resume_state(info["has_optim_state"])
        dcp.load(state, checkpoint_id=str(folder))
        # the frozen keys (a LoRA base) are absent by design, which a strict load would reject
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        if "optim" in state:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
        else:
            set_model_state_dict(self.module, state["model"], options=options)
        self.scheduler.load_state_dict(info["scheduler"])
        apply_hyperparameters(self.optimizer, self.scheduler, self.optim_cfg)
        self.updates = int(info["updates"])
