"""Tensor-parallel rollout replicas on the session's simulated 2-node cluster: each replica is one Ray
actor holding a bundle of k devices of one node, and the actor's weight stream reaches each replica
once. The routing test scripts the replicas' sampler; the slow test runs vLLM's CPU build with k=2."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from ppo_trainer.config.composition import compose
from ppo_trainer.workers.accelerators import DeviceKind, detect
from ppo_trainer.workers.cluster.placement import plan_placement
from ppo_trainer.workers.roles import Worker

from ..conftest import computing_on_cpu, node_info, ray_overrides

ray = pytest.importorskip("ray")


@contextmanager
def rollout_hosts(cfg, kind: DeviceKind) -> Iterator[list[Any]]:
    """The rollout pool of `cfg`'s plan alone (the session cluster has 4 GPUs in all), in its placement
    group, one bare `WorkerHost` per replica; removed after."""
    from ppo_trainer.workers.cluster.backend import PlacementPool, fit_on_cluster, spawn_hosts, start_ray

    start_ray(cfg, kind)
    full = plan_placement(cfg)
    placement = dataclasses.replace(full, pools=tuple(p for p in full.pools if p.name == "rollout"),
                                    roles={"rollout": full.roles["rollout"]})
    pool = PlacementPool(placement.pools[0], kind, fit_on_cluster(placement, kind, cfg.devices.ray.address))
    hosts = spawn_hosts("rollout", kind, placement.roles["rollout"], pool)
    try:
        yield hosts
    finally:
        for h in hosts:
            ray.kill(h)
        pool.remove()


def sender(buckets: list[dict[str, torch.Tensor]]) -> Any:
    """The part of the actor's rank-0 Worker that `Worker.push_weights` uses: its engine's buckets."""
    engine = type("Buckets", (), {"weight_buckets": lambda self, bucket_bytes: iter(buckets)})()
    return type("Sender", (), {"engine": engine})()


TP2 = ["sampler=vllm", "sampler.vllm.tensor_parallel_size=2"]


def test_each_replica_is_one_actor_on_two_gpus_of_one_node_and_gets_every_bucket_once(ray_cluster):
    """4 rollout GPUs, k=2: 2 replicas (not 4), one per node of 2 GPUs. The stream sends each bucket to
    each replica once, in order, whole; push_weights counts the bytes one replica received."""

    def script_the_sampler(host) -> None:
        """In the host's process: the rollout builder returns a sampler that records the buckets it gets
        (nested: cloudpickle ships it by value; the test module does not import there)."""
        from ppo_trainer.workers import roles

        class RecordingSampler:
            def __init__(self) -> None:
                self.buckets: list[dict[str, int]] = []  # per bucket: name -> bytes

            def load_weight_bucket(self, state_dict) -> None:
                self.buckets.append({k: v.numel() * v.element_size() for k, v in state_dict.items()})

            def received(self) -> list[dict[str, int]]:
                return self.buckets

        roles.BUILDERS["rollout"] = lambda cfg, device: RecordingSampler()

    cfg = compose(ray_overrides(ray_cluster, actor=1, critic=1, rollout=4) + TP2)
    with rollout_hosts(cfg, computing_on_cpu(detect("cuda"))) as hosts:
        infos = node_info(hosts)
        assert len(hosts) == 2 and infos[0]["node_id"] != infos[1]["node_id"]
        for info in infos:
            assert len(info["device_ids"]) == 2 and info["visible_devices"].split(",") == info["device_ids"]
        ray.get([h.__ray_call__.remote(script_the_sampler) for h in hosts])
        ray.get([h.build.remote(cfg) for h in hosts])
        g = torch.Generator().manual_seed(0)
        buckets = [{"model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
                    "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g)},
                   {"lm_head.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16)}]
        sent = Worker.push_weights(sender(buckets), hosts, bucket_bytes=1)
        expected = [{k: v.numel() * v.element_size() for k, v in b.items()} for b in buckets]
        assert sent == (64 * 32 + 32) * 4 + 16 * 32 * 2
        assert ray.get([h.call.remote("received") for h in hosts]) == [expected, expected]


def greedy(host, prompts) -> list[list[int]]:
    out = ray.get(host.call.remote("generate", prompts, 1, 0, True))
    return [out.response_ids[i][out.response_mask[i].bool()].tolist() for i in range(len(out))]


@pytest.mark.slow
def test_vllm_cpu_with_two_ranks_generates_the_one_rank_engines_greedy_tokens_after_a_weight_sync(
        ray_cluster, tiny_model_dir):
    """vLLM's CPU build, float32, under Ray: one replica of k=2 (a Ray actor with 2 CPU slots; its 2 ranks
    processes of their own, bound to half of the cores each) and one of k=1. After other weights are
    streamed into both, their greedy tokens are equal, and differ from those before the push. Bytes,
    both sides: the stream sends a replica the tensors' bytes, whatever k; each of its engine's ranks
    takes in a whole safetensors file of them."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_trainer.rollout import prompts_to_batch

    base = ["devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false", "devices.devices_per_node=2",
            f"devices.ray.address={ray_cluster}", "model=tiny", f"model.path={tiny_model_dir}", "model.dtype=float32",
            "sampler=vllm", "sampler.max_new_tokens=12", "sampler.vllm.enforce_eager=true",
            "sampler.vllm.kv_cache_gb=0.0625", "data.max_prompt_length=64"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = ["What is 2 + 3?", "Hi", "Count the apples: 7 and 5, how many?"]
    prompts = prompts_to_batch([tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                              add_generation_prompt=True, return_dict=False)
                                for q in questions], tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    names = list(other)
    buckets = [{k: other[k] for k in names[: len(names) // 2]}, {k: other[k] for k in names[len(names) // 2 :]}]
    blob = safetensors.torch.save(other)

    def engine_ranks(host) -> tuple[int, list[int], list[int]]:
        """In the replica's actor: its pid, its engine ranks' pids, the bytes each rank takes in of `blob`."""
        import os

        llm = host.worker.engine.llm
        return os.getpid(), llm.collective_rpc(lambda worker: os.getpid()), llm.collective_rpc(
            "ppo_load_weights", args=(blob,))

    tokens = {}
    kind = detect("cpu")
    for k in (2, 1):
        cfg = compose([*base, f"devices.rollout.num_devices={k}", f"sampler.vllm.tensor_parallel_size={k}"])
        with rollout_hosts(cfg, kind) as (host,):
            ray.get(host.build.remote(cfg))
            before = greedy(host, prompts)
            sent = Worker.push_weights(sender(buckets), [host], bucket_bytes=1)
            ray.get(host.call.remote("finish_weight_sync"))
            tokens[k] = (before, greedy(host, prompts))
            actor, ranks, received = ray.get(host.__ray_call__.remote(engine_ranks))
        assert sent == sum(t.numel() * t.element_size() for t in other.values())
        if k == 2:
            assert len(set(ranks)) == 2 and actor not in ranks and received == [len(blob), len(blob)]
        else:
            assert ranks == [actor] and received == [len(blob)]
    assert tokens[2] == tokens[1]
    assert tokens[2][0] != tokens[2][1], "the pushed weights change the greedy tokens"
