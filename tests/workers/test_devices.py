"""Accelerator naming, placement plans and the fit check: pure functions, no Ray, no devices."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.plan.dry_run import placement_lines
from ppo_trainer.workers import accelerators
from ppo_trainer.workers.accelerators import detect
from ppo_trainer.workers.cluster import placement
from ppo_trainer.workers.cluster.placement import (
    ClusterNode,
    PlacementError,
    assign_nodes,
    plan_placement,
    ray_init_kwargs,
)

from .conftest import computing_on_cpu


def test_explicit_accelerators_map_to_ray_resource_visible_variable_and_backend():
    cuda = detect("cuda")
    assert (cuda.ray_resource, cuda.visible_env, cuda.dist_backend) == ("GPU", "CUDA_VISIBLE_DEVICES", "nccl")
    cpu = detect("cpu")
    assert (cpu.ray_resource, cpu.visible_env, cpu.dist_backend, cpu.torch_device_type) == ("CPU", None, "gloo", "cpu")


def test_npu_detected_without_torch_npu_maps_to_npu_ascend_variable_and_hccl(monkeypatch):
    monkeypatch.setattr(accelerators, "local_device_count", lambda name: 8 if name == "npu" else 0)
    kind = detect("auto")
    assert kind.name == "npu" and kind.torch_device_type == "npu"
    assert kind.ray_resource == "NPU"
    assert kind.visible_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert kind.dist_backend == "hccl"


def test_auto_detects_cpu_on_this_machine_and_rejects_unknown_names():
    assert detect("auto").name == "cpu"
    with pytest.raises(ValueError, match="devices.accelerator"):
        detect("tpu")


def test_computing_on_cpu_keeps_the_ray_resource_and_switches_to_gloo():
    kind = computing_on_cpu(detect("cuda"))
    assert (kind.ray_resource, kind.visible_env) == ("GPU", "CUDA_VISIBLE_DEVICES")
    assert (kind.torch_device_type, kind.dist_backend) == ("cpu", "gloo")


def test_local_ray_registers_the_npus_torch_npu_sees(monkeypatch):
    cfg = compose(["devices=npu"])
    monkeypatch.setattr(placement, "local_device_count", lambda name: 8)
    kwargs = ray_init_kwargs(cfg, detect("npu"))
    assert kwargs["resources"] == {"NPU": 8.0}
    assert kwargs["_node_ip_address"] == "127.0.0.1"
    assert kwargs["include_dashboard"] is False
    monkeypatch.setattr(placement, "local_device_count", lambda name: 0)
    assert "resources" not in ray_init_kwargs(cfg, detect("npu"))


def test_local_ray_declares_a_cpu_per_bundle_on_a_two_core_machine_unless_overridden(monkeypatch):
    cfg = compose(["devices.backend=ray", "devices.actor.num_devices=2", "devices.colocate=false"])
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 2)
    assert ray_init_kwargs(cfg, detect("cpu"))["num_cpus"] == 5  # 4 slots + 1
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 32)
    assert ray_init_kwargs(cfg, detect("cpu"))["num_cpus"] == 32
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 2)
    cfg = compose(["devices.backend=ray", "devices.ray.num_cpus=3", "devices.ray.dashboard=true"])
    kwargs = ray_init_kwargs(cfg, detect("cpu"))
    assert kwargs["num_cpus"] == 3 and kwargs["include_dashboard"] is True


def test_multi_gpu_preset_puts_actor_and_critic_on_node_0_and_rollout_on_node_1():
    p = plan_placement(compose(["devices=multi_gpu"]))
    assert p.roles["actor"].ranks == tuple((0, i) for i in range(4))
    assert p.roles["critic"].ranks == tuple((0, i) for i in range(4, 8))
    assert p.roles["rollout"].ranks == tuple((1, i) for i in range(4))
    assert (p.num_devices, p.num_nodes) == (12, 2)
    assert [pool.strategy for pool in p.pools] == ["STRICT_PACK"] * 3
    assert all(r.share == 1.0 for r in p.roles.values())


def test_colocated_preset_shares_8_devices_rank_i_of_every_role_on_device_i():
    p = plan_placement(compose(["devices=colocated"]))
    (pool,) = p.pools
    assert pool.roles == ("actor", "critic", "rollout") and len(pool.slots) == 8
    for role in ("actor", "critic", "rollout"):
        assert p.roles[role].ranks == pool.slots  # rank i on bundle i
        assert p.roles[role].share == 0.33
    assert p.roles["actor"].share * 3 <= 1.0
    assert (p.num_devices, p.num_nodes, p.num_workers) == (8, 1, 24)


def test_pool_larger_than_a_node_takes_whole_nodes_and_a_small_pool_never_straddles():
    cfg = compose(["devices=multi_gpu", "devices.actor.num_devices=12", "devices.critic.num_devices=6",
                   "devices.rollout.num_devices=2", "data.train_batch_size=16", "algorithm.ppo_mini_batch_size=16"])
    p = plan_placement(cfg)
    pools = {pool.name: pool for pool in p.pools}
    actor, critic, rollout = (pools[r] for r in ("actor", "critic", "rollout"))
    assert actor.per_node() == {0: list(range(8)), 1: [0, 1, 2, 3]}
    assert actor.strategy == "SPREAD"
    assert critic.per_node() == {2: list(range(6))}  # 6 do not fit beside the actor's 4 on node 1
    assert rollout.per_node() == {1: [4, 5]}  # first fit
    assert p.num_nodes == 3


TP = ["sampler=vllm", "sampler.vllm.tensor_parallel_size=2"]


def test_a_tensor_parallel_rollout_is_one_rank_per_replica_on_a_bundle_of_its_k_devices():
    p = plan_placement(compose(["devices=multi_gpu", *TP]))
    rollout = p.roles["rollout"]
    assert (rollout.world_size, rollout.devices_per_rank, rollout.ranks) == (2, 2, ((1, 0), (1, 2)))
    (pool,) = [pool for pool in p.pools if pool.name == "rollout"]
    assert pool.bundles == (((1, 0), (1, 1)), ((1, 2), (1, 3)))
    assert (p.num_devices, p.num_workers) == (12, 10)  # 4 devices, 2 replicas
    assert placement.bundle_spec(detect("cuda"), pool.bundle_size) == {"GPU": 2.0, "CPU": 2.0}
    assert placement.worker_resources(detect("cuda"), rollout.share, rollout.devices_per_rank) == {"GPU": 2.0,
                                                                                                   "CPU": 2.0}
    assert placement.bundle_spec(detect("cpu"), 2) == {"CPU": 2.0}  # a CPU replica: 2 slots, one per rank's process
    assert [pool.bundle_size for pool in p.pools if pool.name != "rollout"] == [1, 1]


def test_a_replica_never_straddles_two_nodes():
    """3 devices a replica on nodes of 4: each node takes one replica and keeps a device free, where
    device-by-device first fit would have split the second replica over two nodes."""
    cfg = compose(["devices=multi_gpu", "devices.devices_per_node=4", "sampler=vllm",
                   "sampler.vllm.tensor_parallel_size=3", "devices.rollout.num_devices=6"])
    (pool,) = [pool for pool in plan_placement(cfg).pools if pool.name == "rollout"]
    assert pool.per_node() == {2: [0, 1, 2], 3: [0, 1, 2]}  # nodes 0 and 1: actor and critic, 4 each
    assert pool.strategy == "SPREAD" and all(len({node for node, _ in b}) == 1 for b in pool.bundles)


def test_a_tensor_parallel_plan_fits_a_cluster_by_devices_and_cpus_per_node():
    p = plan_placement(compose(["devices=multi_gpu_one_node", *TP]))  # 8 GPUs and 8 CPUs on one node
    assert assign_nodes(p, detect("cuda"), [node("a", 8, 8, cpus=8)]) == {0: "a" * 8}
    with pytest.raises(PlacementError, match="needs 8 logical CPUs"):
        assign_nodes(p, detect("cuda"), [node("a", 8, 8, cpus=7)])


def test_the_dry_run_says_how_many_rollout_replicas_of_how_many_devices():
    lines = placement_lines(compose(["devices=multi_gpu_one_node", *TP]))
    assert ("  rollout  2 GPUs (node 0: GPU 6-7); placement group STRICT_PACK, 1 bundle of {GPU: 2, CPU: 2}"
            in lines)
    assert ("    rollout: 1 replica x tensor parallel 2 (node 0: GPU 6-7); one Ray actor per replica, its "
            "engine's 2 ranks in processes of their own") in lines
    assert lines[-1].endswith("; 7 worker processes and 2 vLLM rank processes")
    four = placement_lines(compose(["devices=multi_gpu", *TP]))
    assert "    rollout: 2 replicas x tensor parallel 2 (node 1: GPU 0-1 | node 1: GPU 2-3)" in "\n".join(four)
    one = placement_lines(compose(["devices=multi_gpu"]))
    assert "    rollout: 4 replicas x tensor parallel 1 (node 1: GPU 0-3); one Ray actor per replica" in one


def node(name: str, free: float, total: float, cpus: float = 16.0, resource: str = "GPU") -> ClusterNode:
    """A fake Ray node "aaaaaaaa" with `free` of `total` devices (and `cpus` CPUs unless the devices are CPUs)."""
    extra = {} if resource == "CPU" else {"CPU": cpus}
    return ClusterNode(name * 8, "10.0.0.1", {resource: free, **extra}, {resource: total, **extra})


def test_request_larger_than_the_cluster_names_the_role_and_the_numbers():
    cfg = compose(["devices=multi_gpu", "devices.critic.num_devices=8", "data.train_batch_size=8",
                   "algorithm.ppo_mini_batch_size=8"])
    with pytest.raises(PlacementError) as e:
        assign_nodes(plan_placement(cfg), detect("cuda"), [node("a", 8, 8), node("b", 2, 8)])
    msg = str(e.value)
    assert msg.startswith("devices.critic.num_devices=8 GPUs do not fit: the cluster has 10 GPUs free")
    assert "devices.actor.num_devices=4 take 4" in msg and "16 GPUs in total" in msg


def test_pool_that_fits_in_total_but_not_on_one_node_says_devices_per_node():
    cfg = compose(["devices=colocated"])  # 8 on one node
    with pytest.raises(PlacementError, match=r"no Ray node has that many free .*devices.devices_per_node"):
        assign_nodes(plan_placement(cfg), detect("cuda"), [node("a", 4, 4), node("b", 4, 4)])


def test_plan_nodes_map_to_distinct_ray_nodes_with_room():
    p = plan_placement(compose(["devices=multi_gpu"]))  # node 0: 8 GPUs, node 1: 4 GPUs
    mapping = assign_nodes(p, detect("cuda"), [node("a", 4, 8), node("b", 8, 8)])
    assert mapping == {0: "b" * 8, 1: "a" * 8}


def test_plan_nodes_prefer_distinct_ray_nodes_but_share_a_big_one_when_needed():
    cfg = compose(["devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false",
                   "devices.devices_per_node=2", "devices.actor.num_devices=2", "sampler.n=2"])
    p = plan_placement(cfg)  # plan node 0: actor (2 slots); plan node 1: critic + rollout (2 slots)
    cpu = detect("cpu")
    assert assign_nodes(p, cpu, [node("a", 4, 4, resource="CPU"), node("b", 4, 4, resource="CPU")]) == {
        0: "a" * 8, 1: "b" * 8}
    assert assign_nodes(p, cpu, [node("a", 4, 4, resource="CPU")]) == {0: "a" * 8, 1: "a" * 8}
    with pytest.raises(PlacementError, match="CPU slots do not fit: the cluster has 3 CPU slots free"):
        assign_nodes(p, cpu, [node("a", 3, 4, resource="CPU")])


def test_joined_cluster_without_npus_says_how_to_announce_them():
    cfg = compose(["devices=npu", "devices.ray.address=10.0.0.1:6379"])
    with pytest.raises(PlacementError) as e:
        assign_nodes(plan_placement(cfg), detect("npu"), [node("a", 0, 0, resource="GPU")], "10.0.0.1:6379")
    assert "ray start --address=10.0.0.1:6379 --resources='{\"NPU\": 8}'" in str(e.value)


def test_dry_run_placement_lines_for_the_presets():
    multi = "\n".join(placement_lines(compose(["devices=multi_gpu"])))
    assert "actor    4 GPUs (node 0: GPU 0-3)" in multi
    assert "critic   4 GPUs (node 0: GPU 4-7)" in multi
    assert "rollout  4 GPUs (node 1: GPU 0-3)" in multi
    assert "total: 12 GPUs on 2 nodes of 8" in multi
    one_node = "\n".join(placement_lines(compose(["devices=multi_gpu_one_node"])))
    assert "actor    4 GPUs (node 0: GPU 0-3)" in one_node
    assert "critic   2 GPUs (node 0: GPU 4-5)" in one_node
    assert "rollout  2 GPUs (node 0: GPU 6-7)" in one_node
    assert "total: 8 GPUs on 1 node of 8" in one_node
    colocated = "\n".join(placement_lines(compose(["devices=colocated"])))
    assert "actor/critic/rollout pool 8 GPUs (node 0: GPU 0-7)" in colocated
    assert "each {GPU: 0.33, CPU: 0.33}" in colocated
    npu = "\n".join(placement_lines(compose(["devices=npu"])))
    assert "ASCEND_RT_VISIBLE_DEVICES" in npu and "hccl" in npu
    assert "actor/critic/rollout pool 8 NPUs (node 0: NPU 0-7)" in npu


def test_ppo_train_dry_run_prints_the_multi_gpu_placement_and_warns_about_missing_gpus(tmp_path):
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    args = ["+experiment=gsm8k", "trainer.dry_run=true", "devices=multi_gpu"]
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rollout  4 GPUs (node 1: GPU 0-3)" in result.stdout
    assert "WARNING: devices: the config asks for 12 GPUs on 2 nodes of 8 but this machine has 0" in result.stdout


def test_the_reported_failure_is_a_ranks_own_error_not_its_peers_connection_closed():
    from ppo_trainer.workers.cluster.backend import root_cause

    peer = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5821"
    died = "the worker process died (ActorDiedError: The actor died unexpectedly before finishing this task.)"
    assert root_cause([peer, died]) == 1
    assert root_cause([died, peer]) == 0
    assert root_cause([peer, peer]) == 0


def test_dry_run_plan_says_which_dtype_auto_chose_and_why():
    from ppo_trainer.dtypes import auto_dtype
    from ppo_trainer.plan.dry_run import dtype_summary

    line = dtype_summary(compose(["model=smollm2"]))
    chosen, why = auto_dtype("cpu")
    assert line.startswith(f"actor and rollout {chosen} (model.dtype=auto: {why})")
    assert dtype_summary(compose(["+experiment=smoke"])) == \
        "actor and rollout float32 (model.dtype); critic float32 (critic.dtype)"


def test_an_npu_engine_keeps_the_plain_weight_layout_and_a_cpu_one_sizes_its_cache_in_bytes(tiny_model_dir):
    """vllm-ascend's default NZ layout cannot take pushed weights nor wake from sleep."""
    from ppo_trainer.config.schema import SamplerConfig, VllmConfig
    from ppo_trainer.rollout.vllm import engine_kwargs

    cfg = SamplerConfig(name="vllm", vllm=VllmConfig(kv_cache_gb=2.0))
    npu = engine_kwargs(tiny_model_dir, cfg, "bfloat16", 0, 256, True, False, "npu")
    assert npu["additional_config"] == {"weight_nz_mode": 0} and npu["kv_cache_memory_bytes"] == 2 * 2**30
    assert npu["enable_sleep_mode"] is True and "gpu_memory_utilization" not in npu
    cuda = engine_kwargs(tiny_model_dir, SamplerConfig(name="vllm"), "bfloat16", 0, 256, True, False, "cuda")
    assert cuda["gpu_memory_utilization"] == 0.5 and "additional_config" not in cuda
    cpu = engine_kwargs(tiny_model_dir, SamplerConfig(name="vllm"), "float32", 0, 256, False, False, "cpu")
    assert cpu["kv_cache_memory_bytes"] == 2**30 and cpu["enable_chunked_prefill"] is False


def test_a_worker_saves_and_restores_an_npus_generators(monkeypatch):
    """torch_npu registers torch.npu; its generators travel in the checkpoint like CUDA's."""
    import types

    import torch

    from ppo_trainer.workers import roles

    saved = {"state": None}
    fake = types.SimpleNamespace(is_available=lambda: True, get_rng_state_all=lambda: ["npu-gen-0"],
                                 set_rng_state_all=lambda s: saved.__setitem__("state", s))
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    worker = roles.Worker.__new__(roles.Worker)
    state = worker.rng_state()
    assert state["npu"] == ["npu-gen-0"]
    worker.set_rng_state(state)
    assert saved["state"] == ["npu-gen-0"]
