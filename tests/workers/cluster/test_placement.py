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
def placed_hosts(cfg, kind, handles: bool = False) -> Iterator[dict[str, list]]:
    """Placement groups and bare `WorkerHost` actors of `cfg`'s plan; yields each role's `node_info`, or
    with `handles` its actors."""
    from ppo_trainer.workers.cluster.backend import (
        PlacementPool,
        call_concurrency,
        fit_on_cluster,
        spawn_hosts,
        start_ray,
    )

    start_ray(cfg, kind)
    placement = plan_placement(cfg)
    node_ids = fit_on_cluster(placement, kind, cfg.devices.ray.address)
    pools = {p.name: PlacementPool(p, kind, node_ids) for p in placement.pools}
    hosts = {r: spawn_hosts(r, kind, placement.roles[r], pools[placement.roles[r].pool], call_concurrency(cfg, r))
             for r in placement.roles}
    try:
        yield hosts if handles else {r: node_info(hs) for r, hs in hosts.items()}
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


def seconds_for_two_calls(host) -> float:
    """Wall seconds for two 1 s calls submitted together to one `WorkerHost` actor (once it is up)."""
    def pause(_host, seconds: float) -> None:  # nested: cloudpickle ships it by value into the actor
        import time

        time.sleep(seconds)

    ray.get(host.__ray_call__.remote(pause, 0.0))  # the process started and imported
    start = time.monotonic()
    ray.get([host.__ray_call__.remote(pause, 1.0) for _ in range(2)])
    return time.monotonic() - start


def test_with_partial_rollouts_the_rollout_worker_takes_a_call_beside_a_running_one_and_no_other_role_does(
        ray_cluster):
    """The weight push must reach a rollout worker while its generation runs (a threaded Ray actor);
    every other worker runs its calls one at a time, in order."""
    from ppo_trainer.workers.cluster.backend import call_concurrency

    cfg = compose(ray_overrides(ray_cluster, actor=1, critic=1, rollout=1)
                  + ["sampler=vllm", "sampler.max_staleness=2", "sampler.partial_rollouts=true",
                     "algorithm.rollout_correction=tis"])
    assert {r: call_concurrency(cfg, r) for r in ("actor", "critic", "rollout")} == {"actor": 1, "critic": 1,
                                                                                  "rollout": 3}
    whole = compose(ray_overrides(ray_cluster) + ["sampler.max_staleness=1", "algorithm.rollout_correction=tis"])
    assert call_concurrency(whole, "rollout") == 1  # whole samples: in order, as the lag schedule needs
    with placed_hosts(cfg, computing_on_cpu(detect("cuda")), handles=True) as hosts:
        assert seconds_for_two_calls(hosts["rollout"][0]) < 1.8
        assert seconds_for_two_calls(hosts["actor"][0]) >= 2.0
