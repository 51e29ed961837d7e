"""`RewardModelEngine`: a learned reward, a Hugging Face sequence classifier with one label, that
scores each (prompt messages, response) as its own tokenizer and chat template render them (the
policy's tokens and template play no part), without gradients, in token-budget micro-batches."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ppo_trainer.dtypes import compute_dtype, resolve_dtype
from ppo_trainer.engine.distributed import resolve_device

log = logging.getLogger("ppo_trainer")

Messages = list[dict[str, Any]]


def token_budget_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices in groups whose padded size (rows x longest) stays within `budget` tokens, longest
    rows first (similar lengths share a group: little padding); a row longer than `budget` goes alone."""
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def conversation_ids(tokenizer: Any, messages: Messages, response: str) -> list[int]:
    """A reward model's tokens of the conversation `messages` ending in the assistant's `response`:
    its chat template's rendering, or without one the pair (last user turn, response). ppo-train-rm
    trains on exactly these tokens, so that a trained model scores in PPO as it scored in training."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return tokenizer(question, response)["input_ids"]


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    """A reward model's tokens of a conversation someone else rendered (HH-RLHF's text), as it is."""
    return tokenizer(text)["input_ids"]


class RewardModelEngine:
    """The reward model on `device` in `dtype` ("auto": bfloat16 where the device computes it natively),
    `token_budget` tokens per forward. A tokenizer without a chat template scores the pair (last
    user turn, response), as classic reward models (OpenAssistant's) are trained."""

    rank = 0  # one independent replica per device, as the rollout engines

    def __init__(self, path: str | Path, *, dtype: str = "auto", device: str | torch.device = "cpu",
                 token_budget: int = 4096, trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device.type)
        self.token_budget = token_budget
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=compute_dtype(self.dtype), trust_remote_code=trust_remote_code).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model.path '{path}' is a classifier with {self.model.config.num_labels} labels; "
                             "a reward model has one (num_labels=1): its output is the score")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"reward.model.path '{path}': its tokenizer has neither a pad nor an eos token")
        self.pad_id = pad
        self.model.config.pad_token_id = pad  # the classifier pools the last token that is not padding
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self._truncated_warned = False

    def token_ids(self, messages: Messages, response: str) -> list[int]:
        """The reward model's tokens of the conversation ending in `response`; the first tokens are
        cut when it exceeds the model's length (the response's end is what it judges)."""
        return self._fit(conversation_ids(self.tokenizer, messages, response))

    def _fit(self, ids: list[int]) -> list[int]:
        if self.max_length is not None and len(ids) > self.max_length:
            if not self._truncated_warned:
                log.warning("reward model: a conversation of %d tokens is longer than the model's %d; its first "
                            "tokens are cut", len(ids), self.max_length)
                self._truncated_warned = True
            ids = ids[-self.max_length :]
        return ids

    def score_texts(self, messages: Sequence[Messages], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores of B conversations: each prompt's chat turns, then its response."""
        return self._score([self.token_ids(m, r) for m, r in zip(messages, responses)])

    def score_plain(self, texts: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores of B texts taken as they are (a conversation someone else rendered)."""
        return self._score([self._fit(plain_ids(self.tokenizer, text)) for text in texts])

    @torch.no_grad()
    def _score(self, rows: list[list[int]]) -> torch.Tensor:
        scores = torch.zeros(len(rows), dtype=torch.float32)
        for group in token_budget_groups([len(r) for r in rows], self.token_budget):  # padded: rows x longest
            width = max(len(rows[i]) for i in group)
            input_ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(group), width), dtype=torch.long)
            for k, i in enumerate(group):  # right padding: positions count from 0 in every row
                input_ids[k, : len(rows[i])] = torch.as_tensor(rows[i])
                attention_mask[k, : len(rows[i])] = 1
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)).logits
            scores[group] = logits[:, 0].float().cpu()
        return scores
