"""`CriticEngine`: the value model on FSDP2, as the critic role uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config import AlgorithmConfig, CriticConfig
from ppo_trainer.core.losses import critic_loss
from ppo_trainer.engine.distributed import barrier
from ppo_trainer.engine.fsdp import FSDPEngine, compute_dtype
from ppo_trainer.engine.microbatch import GlobalCounts
from ppo_trainer.engine.optim import critic_optim_config
from ppo_trainer.models.critic import ValueModel


class CriticEngine:
    """The trainable value model (full-parameter; LoRA is rejected), sharded with FSDP2.

    Args:
        cfg: `critic` config.
        model_dir: the resolved `critic.path` (default: the actor's model folder), or a folder
            written by `save_hf` / `ValueModel.save_pretrained`.
        algorithm: PPO settings (loss aggregation, epochs, micro-batch token budget, shuffling).
        mini_batch_size: sequences per optimizer step (`algorithm.ppo_mini_batch_size x sampler.n`).
        device, total_steps, seed: as for `ActorEngine`.
        attn_implementation, trust_remote_code: passed to transformers when loading.

    Every method is a collective call. `update` takes the full batch on every rank;
    `compute_values` takes each rank's own rows.
    """

    def __init__(
        self,
        cfg: CriticConfig,
        model_dir: str | Path,
        algorithm: AlgorithmConfig,
        *,
        mini_batch_size: int,
        device: str | torch.device = "cpu",
        total_steps: Optional[int] = None,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
    ) -> None:
        lora = getattr(cfg, "lora", None)
        if lora is not None and getattr(lora, "rank", 0) > 0:
            raise ValueError(
                "critic.lora: LoRA on the critic is not supported; the value model is trained "
                "full-parameter (LoRA for the actor is model.lora.rank)"
            )
        self.cfg = cfg
        self.algorithm = algorithm
        self.mini_batch_size = mini_batch_size
        self.seed = seed
        self.model = ValueModel.from_pretrained(
            model_dir,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            gradient_checkpointing=cfg.gradient_checkpointing,
        )
        self.engine = FSDPEngine(
            self.model,
            self.model.decoder_layers(),
            device,
            cfg.dtype,
            cfg.cpu_offload,
            critic_optim_config(cfg),
            total_steps,
            fp32_modules=[self.model.value_head],
        )

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def _values(self, micro: Batch) -> torch.Tensor:
        values = self.engine.module(micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_length)
        return torch.where(micro.response_mask.bool(), values, 0)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 V(s_t) for every response token t (the state before t; 0 on padding)."""
        if batch.response_mask is None:
            raise ValueError("batch.response_mask is None; values are computed for generated responses")
        return self.engine.forward_rows(batch, self.algorithm.ppo_micro_batch_tokens, lambda m: (self._values(m),))[0]

    def micro_batch_loss(self, micro: Batch, counts: GlobalCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the mini-batch value loss and statistics (`core.losses.critic_loss`)."""
        return critic_loss(self._values(micro), micro.values, micro.returns, micro.response_mask, self.cfg.value_clip,
                           self.algorithm.loss_agg_mode, counts.tokens, counts.seqs)

    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update on the full batch (identical on every rank).

        Needs values (the rollout-time V, for clipping) and returns. Returns the means over
        mini-batches of critic/vf_loss, critic/vf_clipfrac, critic/grad_norm, critic/lr.
        """
        for name in ("response_mask", "values", "returns"):
            if getattr(batch, name) is None:
                raise ValueError(f"batch.{name} is None; the critic update needs it")
        a = self.algorithm
        stats = self.engine.train(batch, self.micro_batch_loss, self.mini_batch_size, a.ppo_epochs,
                                  a.ppo_micro_batch_tokens, a.shuffle_mini_batches, self.seed)
        return {f"critic/{k}": v for k, v in stats.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full float32 weights on rank 0 ({} elsewhere), keyed as `ValueModel.state_dict()`."""
        return self.engine.full_state_dict()

    def save_hf(self, folder: str | Path) -> None:
        """The value model as a Hugging Face folder (backbone in the compute dtype, head in
        float32); reload with `ValueModel.from_pretrained` or `CriticEngine(..., folder, ...)`."""
        state = self.full_state_dict()
        if self.rank == 0:
            self.model.save_pretrained(folder, state_dict=state, dtype=compute_dtype(self.engine.dtype))
        barrier()

    def save_state(self, folder: str | Path) -> None:
        """Exact-resume state (fp32 weights, AdamW, schedule) into `folder` (DCP)."""
        self.engine.save_state(folder)

    def load_state(self, folder: str | Path) -> None:
        """Restore `save_state`'s folder into this (freshly built) engine."""
        self.engine.load_state(folder)
