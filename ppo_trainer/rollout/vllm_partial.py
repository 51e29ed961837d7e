"""Partial rollouts (`sampler.partial_rollouts`, docs/async.md): a vLLM engine whose generation a weight
push pauses instead of waiting for. It is vLLM's `AsyncLLM`, whose requests can be frozen in place
(`pause_generation(mode="keep")`) while weights load and continued afterwards; today's `vllm.LLM` runs
one blocking `generate` at a time and cannot. `AsyncLLM` always runs its engine core in a process of its
own (on CPU its model in a third), so weights travel as safetensors bytes and start-up takes 20-45 s on
CPU instead of a few; the default path (`rollout.vllm.VllmSampler`) is untouched.

A push, as the actor's rank 0 streams it (`Worker.push_weights`) while a `generate` call runs on another
thread of the rollout worker (a threaded Ray actor: `cluster.backend.call_concurrency`):

1. the first `load_weight_bucket` pauses the engine, keeping its requests; every bucket loads
   (`rollout.vllm.WeightSyncExtension`);
2. `set_policy_version(v)` labels the new weights (vLLM's weight version, which the engine attaches to
   every token it samples from then on);
3. `finish_weight_sync` drops every KV block computed with the old weights, the paused requests' too
   (vLLM preempts them: on resume each recomputes its context, prompt and tokens so far, with the new
   weights), and resumes.

So each token is sampled from exactly one policy version: before the cut from the old weights, after it
from the new, and its logprob (`sample_logprobs`) is under the policy that sampled it, which keeps the
rollout correction (TIS / MIS) exact per token. Each token's label comes back as `Batch.token_version`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from pathlib import Path
from typing import Any, Awaitable, Optional, Sequence, TypeVar

import safetensors.torch
import torch

from ppo_trainer.config.schema import SamplerConfig
from ppo_trainer.dtypes import compute_dtype, resolve_dtype
from ppo_trainer.models.export import safetensors_ready
from ppo_trainer.rollout.base import Completion
from ppo_trainer.rollout.vllm import (
    VllmSampler,
    check_vllm_available,
    completion,
    engine_kwargs,
    generation_eos_ids,
    samples_in_order,
    starting_environment,
)

T = TypeVar("T")


def span_versions(spans: Optional[Sequence[Any]], length: int) -> list[int]:
    """Each of a sample's `length` tokens' policy version, from vLLM's weight-version spans of it
    (`CompletionOutput.weight_versions`: [WeightVersionSpan(version: str, start, end)], end exclusive,
    in token order, covering its tokens)."""
    spans = list(spans or [])
    ends = [0] + [s.end for s in spans]  # each span starts where the one before ended
    if [s.start for s in spans] != ends[:-1] or ends[-1] != length:
        raise ValueError(f"vLLM's weight-version spans {[(s.start, s.end) for s in spans]} do not cover the "
                         f"sample's {length} tokens")
    return [int(s.version) for s in spans for _ in range(s.start, s.end)]


class PartialVllmSampler(VllmSampler):
    """One `AsyncLLM` engine on HF folder `model_dir` (a `PartialSampler`): `VllmSampler`'s `generate` and
    `complete` over its own `_run` (its own engine: `VllmSampler.__init__` is not called), each token
    labelled with its policy version. `generate` may run on several threads at
    once and beside a weight push. It never sleeps: partial rollouts need sampler.max_staleness >= 1,
    whose engines stay awake (docs/async.md)."""

    def __init__(self, model_dir: str | Path, cfg: SamplerConfig, *, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: Optional[int] = None, trust_remote_code: bool = False) -> None:
        if problem := check_vllm_available():
            raise ImportError(problem)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        dtype = resolve_dtype(dtype, current_platform.device_type)
        self.dtype = compute_dtype(dtype)
        kwargs = engine_kwargs(model_dir, cfg, dtype, seed, cfg.vllm.max_model_len or max_model_len, False,
                               trust_remote_code, current_platform.device_type)
        # AsyncLLM's calls are coroutines and its output handler a task of the loop it was built in:
        # one loop, on a thread of its own, serves every thread that calls this sampler
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-async-llm", daemon=True).start()

        async def start() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True))

        with starting_environment(cfg, current_platform.is_cpu(), {}):  # tensor-parallel CPU ranks: their cores
            self.llm = self._wait(start())
        self._wait(self.llm.update_weight_version("0"))  # the model folder's weights: policy version 0
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = generation_eos_ids(model_dir, tokenizer)
        self._request_ids = itertools.count()
        self._paused = False  # by the push under way (only the pushing thread reads and writes it)

    def _wait(self, call: Awaitable[T]) -> T:
        """Run a coroutine on the engine's loop; block this thread until it returns."""
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def sleep(self) -> None:
        """A no-op: the engine stays awake (see the class)."""

    def wake(self) -> None:
        """A no-op: the engine stays awake (see the class)."""

    def load_weight_bucket(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load some of the weights (whole layers); the first bucket of a push pauses the engine, its
        requests kept where they are."""
        if not self._paused:
            self._wait(self.llm.pause_generation(mode="keep", clear_cache=False))
            self._paused = True
        weights = safetensors.torch.save(safetensors_ready(state_dict, self.dtype))  # the worker is another process
        self._wait(self.llm.collective_rpc("ppo_load_weights", args=(weights,)))

    def set_policy_version(self, version: int) -> None:
        """Label the loaded weights: tokens sampled after `finish_weight_sync` carry `version`."""
        self._wait(self.llm.update_weight_version(str(version)))

    def finish_weight_sync(self) -> None:
        """After the last bucket: drop the KV computed with the old weights, the paused requests'
        included (they recompute their context with the new weights), and resume."""
        self._wait(self.llm.reset_prefix_cache(reset_running_requests=True))
        self._wait(self.llm.resume_generation())
        self._paused = False

    def _run(self, prompts: list[list[int]], params: list[Any]) -> list[Completion]:
        """The samples of every request, request by request, each request's in sample order."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        async def request(prompt: list[int], p: Any) -> Any:
            p.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, at its end
            request_id = f"ppo-{next(self._request_ids)}"
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), p, request_id):
                final = out
            return final

        async def requests() -> list[Any]:
            return await asyncio.gather(*(request(prompt, p) for prompt, p in zip(prompts, params)))

        return [dataclasses.replace(completion(s, self.cfg.stop),
                                    versions=span_versions(s.weight_versions, len(s.token_ids)))
                for s in samples_in_order(self._wait(requests()))]
