"""`ActorEngine`: the policy (and the reference policy) on FSDP2."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import AlgorithmConfig, ModelConfig
from ppo_trainer.core.losses import actor_loss, positive_examples
from ppo_trainer.engine.distributed import barrier, resolve_device
from ppo_trainer.engine.fsdp import FSDPEngine, compute_dtype
from ppo_trainer.engine.microbatch import GlobalCounts
from ppo_trainer.models.actor import CausalLMPolicy, load_causal_lm
from ppo_trainer.models.export import save_hf_weights
from ppo_trainer.models.lora import lora_scalings, merge_lora_state_dict, save_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


class ActorEngine(FSDPEngine):
    """The trainable policy on FSDP2, plus the reference policy with `use_reference` (with LoRA the
    same module with the adapter disabled, otherwise a frozen copy of the initial weights).

    `mini_batch_size`: sequences per optimizer step. `temperature, top_k, top_p`: the sampler's;
    logprobs are those of softmax(logits / temperature) under its truncation, except the
    reference's, whose full support keeps the KL to it finite. `correct_score`: reward.correct_score,
    the score of a correct response (algorithm.positive_lm_examples=correct). Every method is a
    collective call.
    """

    def __init__(
        self, cfg: ModelConfig, model_dir: str | Path, algorithm: AlgorithmConfig, *, mini_batch_size: int,
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, use_reference: bool = False,
        device: str | torch.device = "cpu", total_steps: Optional[int] = None, seed: int = 0,
        correct_score: float = 1.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.correct_score = correct_score
        self.algorithm = algorithm
        self.mini_batch_size = mini_batch_size
        self.temperature = temperature
        self.truncation = {"top_k": top_k, "top_p": top_p}
        self.seed = seed
        lora = cfg.lora is not None and cfg.lora.rank > 0
        # a LoRA base is frozen: stored in the compute dtype (half the memory of float32, the same
        # forward, as FSDP would cast it anyway); the adapter keeps float32 master weights
        base_dtype = compute_dtype(cfg.dtype, resolve_device(device).type) if lora else torch.float32
        lm = load_causal_lm(str(model_dir), attn_implementation=cfg.attn_implementation,
                            trust_remote_code=cfg.trust_remote_code,
                            gradient_checkpointing=cfg.gradient_checkpointing, lora=cfg.lora, dtype=base_dtype)
        self.policy = CausalLMPolicy(lm, cfg.logprob_chunk_tokens, algorithm.pack_sequences)
        self.lora_scalings = lora_scalings(self.policy.lm) if self.policy.is_lora else {}
        super().__init__(self.policy, self.policy.decoder_layers(), device, cfg.dtype, cfg.cpu_offload, cfg.optim,
                         total_steps)
        self.reference: Optional[FSDPEngine] = None
        self.use_reference = use_reference
        if use_reference and not self.policy.is_lora:
            frozen = CausalLMPolicy(  # stored in the compute dtype: it is never updated
                load_causal_lm(str(model_dir), attn_implementation=cfg.attn_implementation,
                               trust_remote_code=cfg.trust_remote_code, dtype=compute_dtype(self.dtype)),
                cfg.logprob_chunk_tokens, algorithm.pack_sequences,
            )
            self.reference = FSDPEngine(frozen, frozen.decoder_layers(), device, self.dtype, cfg.cpu_offload)

    def _score(self, engine: FSDPEngine, batch: Batch, with_entropy: bool, truncate: bool = True) -> list[torch.Tensor]:
        batch.require("response_mask", user="scoring")
        truncation = self.truncation if truncate else {}

        def fn(micro: Batch) -> tuple[torch.Tensor, ...]:
            logp, ent = engine.module(
                micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_mask,
                self.temperature, with_entropy, **truncation,
            )
            return (logp,) if ent is None else (logp, ent)

        return engine.forward_rows(batch, self.algorithm.ppo_micro_batch_tokens, fn)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 logprobs of the response tokens under the current policy (0 on padding)."""
        return self._score(self, batch, with_entropy=False)[0]

    def compute_logprobs_and_entropy(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] logprobs and [B, T] entropies of softmax(logits / temperature) (0 on padding)."""
        logp, ent = self._score(self, batch, with_entropy=True)
        return logp, ent

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] logprobs under the reference policy (the initial weights), untruncated."""
        if not self.use_reference:
            raise RuntimeError("the reference policy was not built (use_reference=False)")
        if self.reference is not None:
            return self._score(self.reference, batch, with_entropy=False, truncate=False)[0]
        with self.policy.adapter_disabled():
            return self._score(self, batch, with_entropy=False, truncate=False)[0]

    def micro_batch_loss(self, micro: Batch, counts: GlobalCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the mini-batch loss and statistics (`core.losses.actor_loss`)."""
        logp, ent = self.module(micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_mask,
                                self.temperature, self.algorithm.entropy_coef > 0, **self.truncation)
        return actor_loss(logp, ent, micro.old_logprobs, micro.advantages, micro.response_mask, micro.ref_logprobs,
                          micro.rollout_weights, self.algorithm, counts.tokens, counts.seqs, micro.positive,
                          counts.positive_tokens)

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO policy update on the full batch (`FSDPEngine.train`); the actor/* metrics of
        `core.losses.actor_loss` plus grad_norm, lr and skipped_steps. With the positive-example LM
        loss its responses are chosen here, on the whole batch (`core.losses.positive_examples`)."""
        a = self.algorithm
        batch.require("response_mask", "old_logprobs", "advantages", *(["ref_logprobs"] if a.use_kl_loss else []),
                      *(["rollout_weights"] if a.rollout_correction != "none" else []),
                      *(["scores"] if a.positive_lm_loss_coef > 0 else []), user="the actor update")
        if a.positive_lm_loss_coef > 0:
            batch = batch.with_fields(positive=positive_examples(batch.scores, batch.prompt_groups(),
                                                                 a.positive_lm_examples, self.correct_score))
        stats = self.train(batch, self.micro_batch_loss, self.mini_batch_size, a, self.seed, a.ppo_epochs)
        return {f"actor/{k}": v for k, v in stats.items()}

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Full float32 state on rank 0 with the wrapper prefix removed ({} elsewhere)."""
        return {k[len("lm.") :]: v for k, v in super().full_state_dict().items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights of the current policy, with Hugging Face names, on rank 0 ({} elsewhere), for
        weight sync and exports: float32, except that with LoRA the adapter is merged into the base
        weights (float32 where merged), under the base model's names, the rest in the compute dtype."""
        state = self._gathered()
        if state and self.policy.is_lora:
            state = merge_lora_state_dict(state, self.lora_scalings)
        return state

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The current policy's weights with Hugging Face names (LoRA merged into the base), in the
        compute dtype, as CPU buckets of about `bucket_bytes` on rank 0 (nothing elsewhere). A
        collective: every rank iterates. One decoder layer at a time is gathered (FSDP all-gather),
        merged and cast on this rank's device, so no full copy of the model sits in host memory;
        a layer never straddles two buckets (an engine reloading a bucket gets whole layers)."""
        dtype = compute_dtype(self.dtype)
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for group in layer_groups(list(self.module.state_dict().items())):
            full = {key[len("lm.") :]: value.full_tensor() if isinstance(value, DTensor) else value
                    for key, value in group}
            if self.policy.is_lora:
                full = merge_lora_state_dict(full, self.lora_scalings)
            if self.rank != 0:
                continue
            for key, value in full.items():
                bucket[key] = (value.to(dtype) if value.is_floating_point() else value).to("cpu", copy=True)
                size += bucket[key].numel() * bucket[key].element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
        if bucket:
            yield bucket

    def save_hf(self, folder: str | Path, merged_folder: Optional[str | Path] = None) -> None:
        """Hugging Face export into `folder` (weights in the compute dtype, tokenizer files); with
        LoRA the adapter instead, and the merged weights as a plain model folder in `merged_folder`."""
        folder = Path(folder)
        state = self._gathered()
        if self.rank == 0:
            if self.policy.is_lora:
                save_adapter(self.policy.lm, state, folder)
                self._copy_tokenizer(folder)
                if merged_folder is not None:
                    self._write_model(Path(merged_folder), merge_lora_state_dict(state, self.lora_scalings))
            else:
                self._write_model(folder, state)
        barrier()

    def _write_model(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """A full model folder: config, weights in the compute dtype, generation config, tokenizer."""
        hf_model = self.policy.hf_model
        folder.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(hf_model.config)
        config.use_cache = True  # off for training; whoever loads the export generates with it
        save_hf_weights(folder, config, state, compute_dtype(self.dtype))
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(folder)
        self._copy_tokenizer(folder)

    def _copy_tokenizer(self, folder: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, folder / name)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_groups(items: list[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """`items` (state dict order) in runs of one decoder layer each (keys with `.layers.N.`); every
    other key (embeddings, final norm, lm_head) is a run of its own."""
    group: list[tuple[str, Any]] = []
    current: Optional[str] = None
    for key, value in items:
        match = _LAYER.search(key)
        layer = match.group(1) if match else None
        if group and (layer is None or layer != current):
            yield group
            group = []
        group.append((key, value))
        current = layer
    if group:
        yield group
