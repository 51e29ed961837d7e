"""Rollouts with Hugging Face `generate` on the sampler's own copy of the model (no extra install)."""

from __future__ import annotations

import bisect
import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import SamplerConfig
from ppo_trainer.dtypes import compute_dtype
from ppo_trainer.rollout.base import (
    Completion,
    RowSampling,
    assemble_rollout,
    cut_at_stop,
    prompt_token_lists,
    prompts_to_batch,
)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids: list[int] = []
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id and the model's generation_config names none")
    return list(dict.fromkeys(int(i) for i in ids))


class HFSampler:
    """Batched `model.generate` on the sampler's own copy of the model in `model_dir`, loaded in `dtype`
    ("auto" for `device`); `batch_size` rows (of prompts x n) per call bound the KV cache and the
    scores. Sampling logprobs: the log-softmax of the scores after temperature, top-k, top-p (as the
    actor recomputes them); the model's generation_config.json is not applied."""

    def __init__(self, model_dir: str | Path, cfg: SamplerConfig, *, batch_size: int = 64, dtype: str = "float32",
                 device: str | torch.device = "cpu", trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"HFSampler batch_size must be >= 1, got {batch_size}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(  # never trained: eval mode, no dropout
            model_dir, dtype=compute_dtype(dtype, torch.device(device).type), trust_remote_code=trust_remote_code,
        ).to(device).eval()
        self.device = next(self.model.parameters()).device
        self.cfg = cfg
        self.batch_size = batch_size
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._synced: set[str] = set()  # names loaded since the last finish_weight_sync

    def sleep(self) -> None:
        """No-op: the HF sampler holds no memory beyond its module."""

    def wake(self) -> None:
        """No-op."""

    def load_weight_bucket(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy some of the weights (HF names) into the model."""
        result = self.model.load_state_dict(state_dict, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"weight sync: names unknown to the sampler's model: {result.unexpected_keys[:5]}")
        self._synced.update(state_dict)

    def finish_weight_sync(self) -> None:
        """After the last bucket: every parameter must have come (tied weights count once)."""
        missing = [k for k in dict(self.model.named_parameters()) if k not in self._synced]
        self._synced = set()
        if missing:
            raise KeyError(f"weight sync: the state dict lacks parameters: {missing[:5]}")

    def generate(self, batch: Batch, n: int, seed: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None) -> Batch:
        prompts = prompt_token_lists(batch)
        rows = [p for p in prompts for _ in range(n)]
        setting = RowSampling(max_new_tokens or self.cfg.max_new_tokens, temperature or None)
        with self._seeded(seed):  # one generator across the chunks
            done = [c for start in range(0, len(rows), self.batch_size)
                    for c in self._complete_chunk(rows[start : start + self.batch_size], greedy, setting)]
        return assemble_rollout(batch, n, [c.token_ids for c in done], [c.logprobs for c in done],
                                [not c.stopped for c in done], [c.text for c in done], self.pad_id)

    def complete(self, contexts: Sequence[Sequence[int]], seeds: Sequence[int], settings: Sequence[RowSampling],
                 greedy: bool = False) -> list[Completion]:
        """`ContinuingSampler.complete`: the rows with equal settings generate together, in chunks of
        `batch_size`; `model.generate` samples a chunk from one generator, seeded with its first row's seed."""
        groups: dict[RowSampling, list[int]] = {}
        for row, setting in enumerate(settings):
            groups.setdefault(setting, []).append(row)
        out: list[Optional[Completion]] = [None] * len(contexts)
        for setting, rows in groups.items():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                with self._seeded(seeds[chunk[0]]):
                    completions = self._complete_chunk([list(contexts[r]) for r in chunk], greedy, setting)
                for row, completion in zip(chunk, completions):
                    out[row] = completion
        return out

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """Seeded sampling, without touching the global RNG state."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            yield

    def _complete_chunk(self, contexts: list[list[int]], greedy: bool, setting: RowSampling) -> list[Completion]:
        """The completion of each context, cut at EOS or the stop string that ends it."""
        completions = []
        for ids, lps in zip(*self._generate_chunk(contexts, greedy, setting)):
            end, stopped = self._response_end(ids)
            text = cut_at_stop(self.tokenizer.decode(ids[:end], skip_special_tokens=True), self.cfg.stop)[0]
            completions.append(Completion(ids[:end], lps[:end], stopped, text))
        return completions

    def _generate_chunk(self, prompts: list[list[int]], greedy: bool,
                        setting: RowSampling) -> tuple[list[list[int]], list[list[float]]]:
        """Generated tokens (up to setting.max_new_tokens, EOS/pad included) and their logprobs, per row."""
        from transformers import GenerationConfig

        chunk = prompts_to_batch(prompts, self.pad_id)
        c = self.cfg
        max_new_tokens = setting.max_new_tokens
        sampling = (dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=c.temperature if setting.temperature is None else setting.temperature,
            top_p=c.top_p if setting.top_p is None else setting.top_p,
            top_k=c.top_k if setting.top_k is None else setting.top_k))
        # ignore_eos: generate's way is to forbid EOS until max_new_tokens (it never stops early
        # otherwise); vLLM instead samples past EOS. Both give full-length rows.
        gen_cfg = GenerationConfig(**sampling, max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens if c.ignore_eos else 0, eos_token_id=self.eos_ids,
                                   pad_token_id=self.pad_id, stop_strings=list(c.stop) or None,
                                   return_dict_in_generate=True, output_scores=True)
        # generate fills the fields gen_cfg leaves unset from the model's generation_config.json
        # (min_p, repetition_penalty, ...), changing the sampled policy: hide it meanwhile
        own, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(input_ids=chunk.input_ids.to(self.device),
                                      attention_mask=chunk.attention_mask.to(self.device), generation_config=gen_cfg,
                                      tokenizer=self.tokenizer if c.stop else None)
        finally:
            self.model.generation_config = own
        generated = out.sequences[:, chunk.input_ids.shape[1] :]
        token_logprobs = torch.stack(  # out.scores: one [rows, V] of processed logits per step
            [torch.log_softmax(s.float(), dim=-1).gather(-1, generated[:, t : t + 1]).squeeze(-1)
             for t, s in enumerate(out.scores)], dim=1)
        return generated.cpu().tolist(), token_logprobs.cpu().tolist()

    def _response_end(self, ids: list[int]) -> tuple[int, bool]:
        """(length of the real response, whether it ended on EOS or a stop string). A stop string
        ends it at the token whose decoding first completes one: the shortest prefix before EOS that
        holds one, by bisection (a prefix that holds one keeps holding it as it grows)."""
        eos_at = None if self.cfg.ignore_eos else next((t for t, tok in enumerate(ids) if tok in self.eos_ids), None)
        head = ids if eos_at is None else ids[:eos_at]
        def holds_stop(k: int) -> bool:
            return cut_at_stop(self.tokenizer.decode(head[:k], skip_special_tokens=True), self.cfg.stop)[1]

        if self.cfg.stop and holds_stop(len(head)):  # one decode for the rows (most) that hold none
            return bisect.bisect_left(range(1, len(head) + 1), True, key=holds_stop) + 1, True
        return (len(ids), False) if eos_at is None else (eos_at + 1, True)
