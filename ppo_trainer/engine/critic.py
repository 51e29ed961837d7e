"""`CriticEngine`: the value model on FSDP2."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import AlgorithmConfig, CriticConfig
from ppo_trainer.core.losses import critic_loss
from ppo_trainer.engine.distributed import barrier
from ppo_trainer.engine.fsdp import FSDPEngine, compute_dtype
from ppo_trainer.engine.microbatch import GlobalCounts
from ppo_trainer.models.critic import ValueModel
from ppo_trainer.models.packing import shares_prompts


class CriticEngine(FSDPEngine):
    """The trainable value model on FSDP2, full-parameter (the config has no critic.lora). `model_dir`:
    the resolved `critic.path`, or a folder written by `save_hf`. Every method is a collective call."""

    def __init__(
        self, cfg: CriticConfig, model_dir: str | Path, algorithm: AlgorithmConfig, *, mini_batch_size: int,
        device: str | torch.device = "cpu", total_steps: Optional[int] = None, seed: int = 0,
        attn_implementation: str = "sdpa", trust_remote_code: bool = False,
    ) -> None:
        self.cfg = cfg
        self.algorithm = algorithm
        self.mini_batch_size = mini_batch_size
        self.seed = seed
        self.model = ValueModel.from_pretrained(model_dir, attn_implementation=attn_implementation,
                                                trust_remote_code=trust_remote_code,
                                                gradient_checkpointing=cfg.gradient_checkpointing)
        super().__init__(self.model, self.model.decoder_layers(), device, cfg.dtype, cfg.cpu_offload, cfg.optim,
                         total_steps, fp32_modules=[self.model.value_head], share_prompts=shares_prompts(self.model.backbone))

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
        stats = self.train(batch, self.micro_batch_loss, self.mini_batch_size, self.algorithm, self.seed)
        return {f"critic/{k}": v for k, v in stats.items()}

    def save_hf(self, folder: str | Path) -> None:
        """The value model as a Hugging Face folder (backbone in the compute dtype, head in
        float32); reload with `ValueModel.from_pretrained` or `CriticEngine(..., folder, ...)`."""
        state = self.full_state_dict()
        if self.rank == 0:
            self.model.save_pretrained(folder, state_dict=state, dtype=compute_dtype(self.dtype))
        barrier()
