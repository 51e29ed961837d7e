"""Placement on the session's simulated 2-node cluster, with bare worker processes (no models):
every worker reports the node and devices Ray gave it, which must be those of the plan."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.workers.accelerators import detect
from ppo_trainer.workers.cluster.placement import PlacementError, plan_placement

from ..conftest import computing_on_cpu, node_info, ray_overrides

ray = pytest.importorskip("ray")


def live_placement_groups() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


@contextmanager
def placed_hosts(cfg, kind) -> Iterator[dict[str, list[dict]]]:
    """Placement groups and bare `WorkerHost` actors of `cfg`'s plan; yields each role's `node_info`."""
    from ppo_trainer.workers.cluster.backend import PlacementPool, fit_on_cluster, spawn_hosts, start_ray

    start_ray(cfg, kind)
    placement = plan_placement(cfg)
    node_ids = fit_on_cluster(placement, kind, cfg.devices.ray.address)
    pools = {p.name: PlacementPool(p, kind, node_ids) for p in placement.pools}
    hosts = {r: spawn_hosts(r, kind, placement.roles[r], pools[placement.roles[r].pool]) for r in placement.roles}
    try:
        yield {r: node_info(hs) for r, hs in hosts.items()}
    finally:
        for hs in hosts.values():
            for h in hs:
                ray.kill(h)
        for pool in pools.values():
            pool.remove()


@pytest.fixture
def colocated_hosts(ray_cluster):
    """Colocated roles over 3 shared devices: plan node 0 holds devices 0-1, plan node 1 device 0."""
    cfg = compose(ray_overrides(ray_cluster, colocate=True, actor=3, critic=1, rollout=1) + ["sampler.n=2"])
    with placed_hosts(cfg, computing_on_cpu(detect("cuda"))) as hosts:
        yield hosts


def test_colocated_ranks_share_their_bundles_device_and_a_pool_spans_two_nodes(colocated_hosts):
    actor, critic, rollout = (colocated_hosts[r] for r in ("actor", "critic", "rollout"))
    # rank 0 of every role on bundle 0: one node, one GPU
    assert actor[0]["node_id"] == critic[0]["node_id"] == rollout[0]["node_id"]
    assert actor[0]["device_ids"] == critic[0]["device_ids"] == rollout[0]["device_ids"]
    assert actor[0]["visible_devices"] == critic[0]["visible_devices"] == rollout[0]["visible_devices"]
    # bundles 0 and 1 on plan node 0 (two GPUs of one node), bundle 2 on plan node 1
    assert actor[1]["node_id"] == actor[0]["node_id"] != actor[2]["node_id"]
    assert actor[1]["device_ids"] != actor[0]["device_ids"]
    assert len({i["pid"] for i in actor + critic + rollout}) == 5


def test_npu_pool_lands_on_the_node_announcing_npus_with_ascend_visible_devices(ray_cluster):
    cfg = compose(ray_overrides(ray_cluster, colocate=True, actor=1, critic=1, rollout=1)
                  + ["devices.accelerator=npu"])
    kind = computing_on_cpu(detect("npu"))
    npu_nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("NPU")]
    with placed_hosts(cfg, kind) as hosts:
        infos = [i for role in hosts.values() for i in role]
        assert {i["node_id"] for i in infos} == set(npu_nodes)
        assert len({i["visible_devices"] for i in infos}) == 1
        assert infos[0]["visible_devices"] in ("0", "1")
        assert infos[0]["device_ids"] == [infos[0]["visible_devices"]]


def test_cpu_slots_place_one_worker_per_cpu_bundle_without_visible_devices(ray_cluster):
    cfg = compose(ray_overrides(ray_cluster, actor=2, critic=1, rollout=1)
                  + ["devices.accelerator=cpu", "sampler.n=2"])
    with placed_hosts(cfg, detect("cpu")) as hosts:
        actor, critic, rollout = (hosts[r] for r in ("actor", "critic", "rollout"))
        assert actor[0]["node_id"] == actor[1]["node_id"]
        assert critic[0]["node_id"] == rollout[0]["node_id"] != actor[0]["node_id"]
        assert all(i["visible_devices"] is None and i["device_ids"] == [] for i in actor + critic + rollout)


def test_more_devices_than_the_cluster_has_fails_fast_naming_role_and_numbers(ray_cluster):
    from ppo_trainer.workers.cluster.backend import start_ray
    from ppo_trainer.workers.group import build_groups

    cfg = compose(ray_overrides(ray_cluster, actor=2, critic=8, rollout=1)
                  + ["data.train_batch_size=8", "algorithm.ppo_mini_batch_size=8"])
    start_ray(cfg)
    before = live_placement_groups()
    start = time.monotonic()
    with pytest.raises(PlacementError) as e:
        build_groups(cfg, computing_on_cpu(detect("cuda")))
    assert time.monotonic() - start < 30
    message = str(e.value)
    assert message.startswith("devices.critic.num_devices=8 GPUs do not fit: the cluster has 4 GPUs free, "
                              "of which devices.actor.num_devices=2 take 2")
    assert live_placement_groups() == before, "nothing may be created for a request that does not fit"
