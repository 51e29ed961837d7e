"""`CriticEngine`: the value model on FSDP2."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import AlgorithmConfig, CriticConfig
from ppo_trainer.core.losses import critic_loss
from ppo_trainer.core.value_fit import FOLDS, fit_value_head, fold_statistics
from ppo_trainer.engine.distributed import all_reduce_sum, barrier, resolve_device
from ppo_trainer.engine.fsdp import FSDPEngine, compute_dtype
from ppo_trainer.engine.microbatch import GlobalCounts, plan_micro_batches
from ppo_trainer.models.critic import ValueModel


class CriticEngine(FSDPEngine):
    """The trainable value model on FSDP2: full-parameter, or with critic.lora.rank > 0 LoRA adapters on
    a frozen backbone and the value head trained in full. `model_dir`: the resolved `critic.path`, or a
    folder written by `save_hf`. Every method is a collective call."""

    def __init__(
        self, cfg: CriticConfig, model_dir: str | Path, algorithm: AlgorithmConfig, *, mini_batch_size: int,
        device: str | torch.device = "cpu", total_steps: Optional[int] = None, seed: int = 0,
        attn_implementation: str = "sdpa", trust_remote_code: bool = False,
    ) -> None:
        self.cfg = cfg
        self.algorithm = algorithm
        self.mini_batch_size = mini_batch_size
        self.epochs = algorithm.ppo_epochs if cfg.ppo_epochs is None else cfg.ppo_epochs  # config.derived.critic_epochs
        self.seed = seed
        self.model = ValueModel.from_pretrained(model_dir, attn_implementation=attn_implementation,
                                                trust_remote_code=trust_remote_code,
                                                gradient_checkpointing=cfg.gradient_checkpointing)
        if cfg.lora.rank > 0:
            # a LoRA base is frozen: stored in the compute dtype, as the actor's; adapter and head keep float32
            self.model.add_lora(cfg.lora, compute_dtype(cfg.dtype, resolve_device(device).type))
        self.model.pack_sequences = algorithm.pack_sequences
        super().__init__(self.model, self.model.decoder_layers(), device, cfg.dtype, cfg.cpu_offload, cfg.optim,
                         total_steps, fp32_modules=[self.model.value_head])

    def _values(self, micro: Batch) -> torch.Tensor:
        return self.module(micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_mask)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 V(s_t) for every response token t (the state before t; 0 on padding)."""
        batch.require("response_mask", user="the critic's values")
        return self.forward_rows(batch, self.algorithm.ppo_micro_batch_tokens, lambda m: (self._values(m),))[0]

    def micro_batch_loss(self, micro: Batch, counts: GlobalCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the mini-batch value loss and statistics (`core.losses.critic_loss`)."""
        return critic_loss(self._values(micro), micro.values, micro.returns, micro.response_mask, self.cfg.value_clip,
                           self.algorithm.loss_agg_mode, counts.tokens, counts.seqs)

    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update on the full batch (`FSDPEngine.train`); `values` are the
        rollout-time V the clip refers to."""
        batch.require("response_mask", "values", "returns", user="the critic update")
        stats = self.train(batch, self.micro_batch_loss, self.mini_batch_size, self.algorithm, self.seed, self.epochs)
        return {f"critic/{k}": v for k, v in stats.items()}

    def fit_value_head(self, batch: Batch) -> dict[str, float]:
        """Replace the value head by the ridge fit of `batch.returns` on the states it reads
        (`core.value_fit`: critic.value_head_init=regression, before the first values), the backbone
        untouched; every rank takes its share of the full batch, ranks sum the statistics and all
        solve the same system. Returns critic/value_head_fit/ridge and /cv_explained_var."""
        batch.require("response_mask", "returns", user="the value head's fit")
        fold = torch.zeros(len(batch), dtype=torch.long)
        for g, rows in enumerate(batch.prompt_groups()):  # whole prompts per fold, the same on any number of ranks
            fold[rows] = g % FOLDS
        mine = batch.deal(self.world_size)[self.rank]
        local, fold = batch.select(mine), fold[mine]
        hidden = self.model.value_head.in_features
        stats = torch.zeros(FOLDS, hidden + 2, hidden + 2, dtype=torch.float64)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for micro in plan_micro_batches(local, self.algorithm.ppo_micro_batch_tokens, self.layout):
                    m = micro.batch.to(self.device)
                    _, states = self.module(m.input_ids, m.attention_mask, m.position_ids, m.response_mask,
                                            with_states=True)
                    if not micro.dummy:
                        valid = micro.batch.response_mask.bool()
                        folds = fold[micro.rows][:, None].expand_as(valid)[valid]
                        stats += fold_statistics(states.cpu(), micro.batch.returns[valid], folds)
        finally:
            self.module.reshard()  # the root keeps its parameters gathered after a forward
            self.module.train(was_training)
        weight, bias, metrics = fit_value_head(all_reduce_sum(stats))
        head = {"value_head.weight": weight.float()[None], "value_head.bias": bias.float()[None]}
        set_model_state_dict(self.module, head, options=StateDictOptions(full_state_dict=True, strict=False))
        return {f"critic/value_head_fit/{k}": v for k, v in metrics.items()}

    def save_hf(self, folder: str | Path, merged_folder: Optional[str | Path] = None) -> None:
        """The value model as a Hugging Face folder (backbone in the compute dtype, head in float32);
        with LoRA the adapter and the head instead (`ValueModel.save_lora`), and the merged model in
        `merged_folder`. Either reloads with `ValueModel.from_pretrained` or `CriticEngine(..., folder, ...)`."""
        state = self.full_state_dict()
        if self.rank == 0:
            dtype = compute_dtype(self.dtype)
            if not self.model.is_lora:
                self.model.save_pretrained(folder, state_dict=state, dtype=dtype)
            else:
                self.model.save_lora(folder, state_dict=state)
                if merged_folder is not None:
                    self.model.save_pretrained(merged_folder, state_dict=state, dtype=dtype)
        barrier()
