"""A tensor-parallel vLLM engine (sampler.vllm.tensor_parallel_size k > 1) as the sampler drives it:
its k ranks run in processes of their own ("mp"), so weights reach them as safetensors bytes, every
rank receiving every weight whole; sleep and wake are one call per replica. A scripted `vllm.LLM`
plays the engine: its k ranks are `WeightSyncExtension`s in this process, and it refuses anything but
bytes on the way to a rank that vLLM would put in another process (tensors would arrive there as lists)."""

from __future__ import annotations

import os
import struct
import types

import pytest
import safetensors.torch
import torch

from ppo_trainer.config.schema import SamplerConfig, VllmConfig
from ppo_trainer.models.export import safetensors_ready
from ppo_trainer.rollout.vllm import WeightSyncExtension, cpu_thread_binding, engine_kwargs, executor_backend

from .conftest import load_model


class ScriptedRank(WeightSyncExtension):
    """One rank of the scripted engine: `reload_weights` keeps what it was given."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.loaded.update(weights_iterator)


class ScriptedLLM:
    """The surface of `vllm.LLM` that `VllmSampler` uses, with `tensor_parallel_size` scripted ranks;
    `calls` lists the engine calls in order, `environ` the environment it started in."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.environ = kwargs, dict(os.environ)
        self.ranks = [ScriptedRank() for _ in range(kwargs["tensor_parallel_size"])]
        self.calls: list[str] = []
        self.received: list[int] = []  # what each rank's `ppo_load_weights` returned, by rank, call after call

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if self.kwargs["distributed_executor_backend"] != "uni" and not all(isinstance(a, bytes) for a in args):
            raise TypeError(f"{method}: {[type(a).__name__ for a in args]} would reach ranks in other processes")
        self.calls.append(method)
        results = [getattr(rank, method)(*args) for rank in self.ranks]
        self.received += results
        return results

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake_up({', '.join(tags)})")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def get_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.kwargs["model"])


@pytest.fixture
def scripted_engine(monkeypatch):
    """`scripted_engine(device_type)`: `vllm.LLM` is `ScriptedLLM` and vLLM's platform `device_type`
    ("cuda", "cpu") for the test."""
    pytest.importorskip("vllm")
    import vllm
    import vllm.platforms

    def on(device_type: str) -> None:
        monkeypatch.setattr(vllm, "LLM", ScriptedLLM)  # first: the real one imports with the real platform
        platform = types.SimpleNamespace(device_type=device_type, is_cpu=lambda: device_type == "cpu")
        monkeypatch.setattr(vllm.platforms, "current_platform", platform)

    return on


def tp_config(k: int) -> SamplerConfig:
    return SamplerConfig(name="vllm", vllm=VllmConfig(max_model_len=320, enforce_eager=True, kv_cache_gb=0.0625,
                                                      tensor_parallel_size=k))


def tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_one_device_engines_keep_their_worker_here_and_k_device_engines_run_k_processes(tiny_model_dir):
    """vLLM would turn "uni" into "mp" for k > 1 by itself, silently; the sampler says so up front."""
    assert (executor_backend(1), executor_backend(2), executor_backend(8)) == ("uni", "mp", "mp")
    for k, backend in ((1, "uni"), (4, "mp")):
        kwargs = engine_kwargs(tiny_model_dir, tp_config(k), "bfloat16", 0, 256, False, False, "cuda")
        assert (kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"]) == (k, backend)


def test_cpu_ranks_each_take_their_own_share_of_the_cores_this_process_may_use():
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding(list(range(8)), 2) == "0,1,2,3|4,5,6,7"
    assert cpu_thread_binding([2, 3, 5, 7, 11], 2) == "2,3|5,7,11"
    assert cpu_thread_binding([4], 2) == "4|4"  # fewer cores than ranks: they share


def test_a_two_rank_gpu_engine_gets_every_weight_whole_as_bytes_on_each_rank_and_sleeps_once_per_replica(
        scripted_engine, tiny_model_dir):
    """Bytes per replica, both sides: the sender streams the bucket's tensor bytes once (what
    push_weights counts, `perf/sync_bytes`); each of the 2 ranks receives the whole safetensors file
    of it, those bytes plus its header, and keeps its shard (vLLM's loaders narrow on load)."""
    from ppo_trainer.rollout.vllm import VllmSampler

    scripted_engine("cuda")
    sampler = VllmSampler(tiny_model_dir, tp_config(2), dtype="float32", enable_sleep=True)
    engine = sampler.llm
    assert not sampler._worker_in_process and len(engine.ranks) == 2
    state = load_model(tiny_model_dir).state_dict()
    sampler.sleep()
    sampler.load_weight_bucket(state)
    sampler.finish_weight_sync()
    sampler.wake()
    assert engine.calls == ["sleep(level=1)", "wake_up(weights)", "ppo_load_weights", "reset_prefix_cache",
                            "wake_up(kv_cache)"]
    for rank in engine.ranks:
        assert rank.loaded.keys() == state.keys()
        assert all(torch.equal(rank.loaded[k], state[k]) for k in state)
    blob = safetensors.torch.save(safetensors_ready(state, torch.float32))  # what the sampler serialises
    (header,) = struct.unpack("<Q", blob[:8])  # a safetensors file: the header's length, the header, the tensors
    assert len(blob) == 8 + header + tensor_bytes(state)
    assert engine.received == [len(blob), len(blob)]  # each rank took in the whole file


def test_a_one_rank_engine_gets_the_tensors_handed_over_in_this_process(scripted_engine, tiny_model_dir):
    from ppo_trainer.rollout.vllm import VllmSampler

    scripted_engine("cuda")
    sampler = VllmSampler(tiny_model_dir, tp_config(1), dtype="float32")
    assert sampler._worker_in_process and sampler.llm.kwargs["distributed_executor_backend"] == "uni"
    state = load_model(tiny_model_dir).state_dict()
    sampler.load_weight_bucket(state)
    assert sampler.llm.received == [tensor_bytes(state)]  # no serialising: no header


def test_a_two_rank_cpu_engine_starts_with_each_rank_bound_to_half_of_this_processs_cores(scripted_engine,
                                                                                           tiny_model_dir, monkeypatch):
    """vLLM's default binding wants a NUMA node per rank, which a one-node machine lacks; a binding the
    environment sets is kept. Nothing set for the start outlives it, and a CPU engine never sleeps."""
    from ppo_trainer.rollout.vllm import VllmSampler

    scripted_engine("cpu")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    sampler = VllmSampler(tiny_model_dir, tp_config(2), dtype="float32", enable_sleep=True)
    started = sampler.llm.environ
    assert started["VLLM_CPU_OMP_THREADS_BIND"] == cpu_thread_binding(sorted(os.sched_getaffinity(0)), 2)
    assert started["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core here; its ranks: processes
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    sampler.sleep()
    sampler.wake()
    assert sampler.llm.calls == []
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert VllmSampler(tiny_model_dir, tp_config(2), dtype="float32").llm.environ["VLLM_CPU_OMP_THREADS_BIND"] == \
        "0-3|4-7"
