"""`PairEngine`: a one-label sequence classifier (transformers' `*ForSequenceClassification`, which
`RewardModelEngine` loads in PPO) trained on preference pairs on FSDP2 (`engine.fsdp.FSDPEngine`:
sharding, the optimizer step, the exact-resume state), full-parameter or LoRA (`models.lora`: the
backbone's adapters, the score head trained in full, the export merged)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ppo_trainer.core.pairwise import bradley_terry_loss, pairwise_sums
from ppo_trainer.dtypes import compute_dtype
from ppo_trainer.engine.distributed import resolve_device
from ppo_trainer.engine.fsdp import FSDPEngine
from ppo_trainer.engine.microbatch import GlobalCounts, MicroBatch, accumulate_gradients
from ppo_trainer.engine.reward_model import token_budget_groups
from ppo_trainer.models.export import save_hf_weights
from ppo_trainer.models.lora import add_lora, lora_scalings, merge_lora_state_dict
from ppo_trainer.models.score_stats import write_score_stats
from ppo_trainer.rm.pairs import PairRecord


@dataclass
class PairBatch:
    """n pairs as one padded forward: rows 0..n-1 the chosen sides, n..2n-1 the rejected ones.

    | field          | shape   | meaning                                   |
    |----------------|---------|-------------------------------------------|
    | input_ids      | [2n, L] | right-padded with the pad id              |
    | attention_mask | [2n, L] | 1 on tokens, 0 on padding                 |
    | margin         | [n]     | float32, what chosen must win by          |"""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    margin: torch.Tensor


def pair_batch(pairs: Sequence[PairRecord], pad_id: int, device: torch.device) -> PairBatch:
    """The `PairBatch` of `pairs` on `device`: right padding, as `RewardModelEngine` scores (positions
    count from 0 in every row; the classifier pools each row's last token that is not padding)."""
    rows = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.as_tensor(row)
        attention_mask[i, : len(row)] = 1
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return PairBatch(input_ids.to(device), attention_mask.to(device), margin.to(device))


def micro_batch_pairs(pairs: Sequence[PairRecord], budget: int) -> list[list[int]]:
    """Indices of `pairs` per micro-batch: a pair's two rows pad to the longer side and go together,
    2 x pairs x the longest side <= `budget` tokens (`token_budget_groups`)."""
    return token_budget_groups([max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs], budget // 2)


def load_classifier(model_dir: Path, cfg: Any, pad_id: int, seed: int) -> nn.Module:
    """A one-label sequence classifier in float32 from `model_dir`: a causal LM's backbone with a new
    score head (transformers' initialisation, drawn from `seed`; the global RNG untouched), or a
    classifier's own head. ValueError for a classifier with another number of labels."""
    import json

    from transformers import AutoModelForSequenceClassification

    saved = json.loads((model_dir / "config.json").read_text())
    if any(a.endswith("ForSequenceClassification") for a in saved.get("architectures") or []) \
            and saved.get("num_labels", len(saved.get("id2label") or {}) or 2) != 1:
        raise ValueError(f"model.path '{cfg.path}' is a classifier with several labels; a reward model has one")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, dtype=torch.float32, attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"model.path '{cfg.path}': {type(model).__name__} has no `score` head; ppo-train-rm trains "
                         "the classifiers of decoder models (Llama, Qwen2, Mistral, GPT-2 and the like)")
    model.config.pad_token_id = pad_id  # the classifier pools the last token that is not padding
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class PairEngine(FSDPEngine):
    """The reward model being trained: `update` takes one optimizer step on a batch of pairs, `scores`
    scores pairs without gradients, `save_hf` exports the folder PPO loads. `cfg`: the run's config."""

    def __init__(self, cfg: Any, model_dir: Path, pad_id: int, device: str | torch.device = "cpu") -> None:
        m = cfg.model
        self.pad_id, self.budget = pad_id, cfg.trainer.micro_batch_tokens
        self.classifier = load_classifier(model_dir, m, pad_id, cfg.trainer.seed)
        self.architecture = type(self.classifier).__name__  # before FSDP2 swaps in its FSDP<Name> subclass
        module: nn.Module = self.classifier
        if m.lora.rank > 0:
            # a frozen base in the compute dtype (as the LoRA critic's); adapters and score head in float32
            module = add_lora(self.classifier.to(compute_dtype(m.dtype, resolve_device(device).type)), m.lora, None)
            self.classifier.score.float().requires_grad_(True)
        self.is_lora = m.lora.rank > 0
        backbone = getattr(self.classifier, self.classifier.base_model_prefix)
        super().__init__(module, list(backbone.layers), device, m.dtype, m.cpu_offload, m.optim,
                         cfg.trainer.total_steps, fp32_modules=[self.classifier.score])

    def _scores(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [n], rejected [n]) float32 scores of a `PairBatch`."""
        logits = self.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0].float()
        n = len(batch.margin)
        return logits[:n], logits[n:]

    def _loss(self, batch: PairBatch, counts: GlobalCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch's share of the mini-batch's Bradley-Terry loss (divided by its pairs,
        `counts.seqs`) and its sums (`pairwise_sums`, and the loss share)."""
        chosen, rejected = self._scores(batch)
        loss = bradley_terry_loss(chosen, rejected, batch.margin, denominator=counts.seqs)
        return loss, {**pairwise_sums(chosen, rejected), "loss": loss.detach().double()}

    def update(self, pairs: Sequence[PairRecord]) -> dict[str, float]:
        """One optimizer step on `pairs` (gradient accumulated over micro-batches of
        trainer.micro_batch_tokens, equal to one batch): train/loss, /pairwise_accuracy, /margin/mean,
        /grad_norm, /lr, /skipped_steps."""
        self.module.train()
        micro = [MicroBatch(pair_batch([pairs[i] for i in group], self.pad_id, self.device), torch.tensor(group))
                 for group in micro_batch_pairs(pairs, self.budget)]
        sums = accumulate_gradients(micro, self._loss, GlobalCounts(tokens=0.0, seqs=float(len(pairs))))
        step = self.optimizer_step()
        self.updates += 1
        n = len(pairs)
        return {"train/loss": sums["loss"], "train/pairwise_accuracy": sums["correct"] / n,
                "train/margin/mean": sums["margin"] / n, **{f"train/{k}": v for k, v in step.items()}}

    def scores(self, pairs: Sequence[PairRecord]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [N], rejected [N]) float32 scores of `pairs`, on CPU, without gradients."""
        chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for group in micro_batch_pairs(pairs, self.budget):
                    c, r = self._scores(pair_batch([pairs[i] for i in group], self.pad_id, self.device))
                    chosen[group], rejected[group] = c.cpu(), r.cpu()
        finally:
            self.module.reshard()  # the root keeps its parameters gathered after a forward
            self.module.train(was_training)
        return chosen, rejected

    def save_hf(self, folder: Path, tokenizer: Any, score_stats: dict[str, float]) -> None:
        """`folder`: the `*ForSequenceClassification` as transformers loads it (a LoRA adapter merged;
        the backbone in the compute dtype, the score head in float32), its tokenizer, and
        `score_stats.json` (`models.score_stats`)."""
        state = self.full_state_dict()
        if self.is_lora:
            state = merge_lora_state_dict(state, lora_scalings(self.module))
        head = {k: v.float() for k, v in state.items() if k.startswith("score.")}
        body = {k: v for k, v in state.items() if not k.startswith("score.")}
        save_hf_weights(folder, self.classifier.config, body, compute_dtype(self.dtype), keep_dtype=head,
                        architectures=[self.architecture], num_labels=1, pad_token_id=self.pad_id)
        tokenizer.save_pretrained(folder)
        write_score_stats(folder, score_stats)
