"""The Ray backend on the session's simulated 2-node cluster with fake GPUs (computing on CPU).

Groups: actor x2 (FSDP2 over gloo), critic x1, rollout x1 (vLLM CPU when installed, else HF);
plan with 2 devices per node: the actor's pool on one node, critic and rollout on the other.
One update through the groups must equal the local backend's update on the same hand-built
batch (float32, 1e-5); weights pushed through Ray must make the rollout engine sample from the
updated policy. The failure tests come last: they take the groups down.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.composition import compose
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine
from ppo_trainer.rollout import Sampler
from ppo_trainer.rollout.base import assemble_rollout, prompts_to_batch
from ppo_trainer.workers.accelerators import detect
from ppo_trainer.workers.cluster.placement import plan_placement
from ppo_trainer.workers.group import build_groups

from ..conftest import computing_on_cpu, node_info, ray_overrides

ray = pytest.importorskip("ray")

SAMPLER = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
MATCH = 1e-5  # float32, 2 FSDP ranks vs 1 process
SYNC_MATCH = 1e-3  # the engine's sampling logprobs vs the actor's recompute


def overrides(model_dir: Path) -> list[str]:
    """Float32 tiny model; 4 prompts x 2 samples per step, mini-batches of 4 sequences (2 optimizer
    steps); no KL (no reference model to build). The actor's Adam eps is large so that its step is
    linear in the gradient: with eps=1e-8 an element whose gradient nearly cancels (|g| ~ eps) moves
    by a fraction of lr that float32 summation order decides (2 ranks vs 1 process, thread count:
    2e-5 weight gaps), which would hide what the weight comparison checks."""
    return [
        "model=tiny", f"model.path={model_dir}", "model.dtype=float32", "critic.dtype=float32",
        "model.optim.lr=1e-3", "model.optim.eps=1e-3", "critic.optim.lr=1e-3", f"sampler={SAMPLER}", "sampler.n=2", "sampler.max_new_tokens=8",
        "sampler.vllm.enforce_eager=true", "sampler.vllm.kv_cache_gb=0.0625", "data.max_prompt_length=64",
        "data.train_batch_size=4", "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_micro_batch_tokens=96",
        "gae.kl_coef=0", "trainer.total_steps=1",
    ]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> Batch:
    questions = ["What is 2 + 3?", "Hi", "Count the apples: 7 and 5, how many?", "Name a color."]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for q in questions]
    return prompts_to_batch(ids, tokenizer.pad_token_id, prompt_text=questions)


@pytest.fixture(scope="module")
def batch(prompts, tokenizer) -> Batch:
    """A rollout Batch built by hand: 2 random responses per prompt (lengths 3..8, the shorter ones
    ending in EOS), random old logprobs, values, returns and advantages."""
    g = torch.Generator().manual_seed(0)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    responses, logprobs = [], []
    for row in range(len(prompts) * 2):
        length = 3 + row % 6
        ids = torch.randint(4, vocab, (length,), generator=g).tolist()
        if length < 8:
            ids[-1] = eos
        responses.append(ids)
        logprobs.append([-4.0] * length)
    rollout = assemble_rollout(prompts, 2, responses, logprobs, [len(r) == 8 for r in responses],
                               [""] * len(responses), tokenizer.pad_token_id)
    mask = rollout.response_mask.float()
    shape = mask.shape
    return rollout.with_fields(
        old_logprobs=(-4.0 + 0.1 * torch.randn(shape, generator=g)) * mask,
        advantages=torch.randn(shape, generator=g) * mask,
        values=0.1 * torch.randn(shape, generator=g) * mask,
        returns=torch.randn(shape, generator=g) * mask,
    )


@pytest.fixture(scope="module")
def ray_cfg(ray_cluster, tiny_model_dir, tmp_path_factory):
    return compose(overrides(tiny_model_dir) + ray_overrides(ray_cluster, actor=2, critic=1, rollout=1)
                   + [f"trainer.output_dir={tmp_path_factory.mktemp('ray-run')}"])


@pytest.fixture(scope="module")
def ray_groups(ray_cfg):
    groups = build_groups(ray_cfg, computing_on_cpu(detect("cuda")))
    yield groups
    for group in groups.values():
        group.shutdown()


@pytest.fixture(scope="module")
def local_groups(tiny_model_dir):
    cfg = compose(overrides(tiny_model_dir) + ["sampler=hf", "devices=cpu"])
    groups = build_groups(cfg)
    yield groups
    for group in groups.values():
        group.shutdown()


def infos(group) -> list[dict]:
    """`node_info` of every rank of a Ray group."""
    return node_info(group.workers.hosts)


def test_workers_run_where_the_plan_says(ray_cfg, ray_groups):
    plan = plan_placement(ray_cfg)
    assert [plan.roles[r].ranks for r in ("actor", "critic", "rollout")] == [((0, 0), (0, 1)), ((1, 0),), ((1, 1),)]
    node_of_plan_node: dict[int, str] = {}
    for role in ("actor", "critic", "rollout"):
        reported = infos(ray_groups[role])
        assert len(reported) == plan.roles[role].world_size
        for (plan_node, _), info in zip(plan.roles[role].ranks, reported):
            assert node_of_plan_node.setdefault(plan_node, info["node_id"]) == info["node_id"], (role, info["rank"])
    assert len(set(node_of_plan_node.values())) == 2, "two plan nodes, two Ray nodes"
    actor, critic, rollout = (infos(ray_groups[r]) for r in ("actor", "critic", "rollout"))
    assert sorted(i["visible_devices"] for i in actor) == ["0", "1"]
    assert {critic[0]["visible_devices"], rollout[0]["visible_devices"]} == {"0", "1"}
    assert len({i["pid"] for i in actor + critic + rollout}) == 4


def test_fsdp_ranks_join_their_group_with_gloo_on_loopback_and_rollout_replicas_join_none(ray_groups):
    actor = infos(ray_groups["actor"])
    assert [i["group"] for i in actor] == [(0, 2), (1, 2)]
    assert {i["gloo_interface"] for i in actor} == {"lo"}  # the interface that reaches the rendezvous, 127.0.0.1
    assert infos(ray_groups["critic"])[0]["group"] == (0, 1)
    assert infos(ray_groups["rollout"])[0]["gloo_interface"] is None


def test_logprobs_and_values_split_over_ray_ranks_match_the_local_backend(ray_groups, local_groups, batch):
    for role, method in (("actor", ActorEngine.compute_logprobs), ("critic", CriticEngine.compute_values)):
        remote = ray_groups[role].run_split(method, batch)
        local = local_groups[role].run_split(method, batch)
        assert remote.shape == local.shape == batch.response_mask.shape
        assert (remote - local).abs().max().item() < MATCH, role


def test_one_update_through_ray_gives_the_local_backends_weights(ray_groups, local_groups, batch):
    for role in ("critic", "actor"):
        update = {"actor": ActorEngine.update, "critic": CriticEngine.update}[role]
        remote_stats = ray_groups[role].run_all(update, batch)
        local_stats = local_groups[role].run_all(update, batch)[0]
        assert remote_stats[0].keys() == local_stats.keys()
        for key, value in local_stats.items():
            if key.endswith("/padding_share"):  # each rank pads its own micro-batches: 2 ranks pad differently
                continue
            assert remote_stats[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    remote_weights = ray_groups["actor"].run_all(ActorEngine.full_state_dict)
    assert remote_weights[1] == {}  # gathered on rank 0 only
    local_weights = local_groups["actor"].run_all(ActorEngine.full_state_dict)[0]
    assert remote_weights[0].keys() == local_weights.keys()
    gap = max((remote_weights[0][k] - local_weights[k]).abs().max().item() for k in local_weights)
    assert gap < MATCH
    values_gap = (ray_groups["critic"].run_split(CriticEngine.compute_values, batch)
                  - local_groups["critic"].run_split(CriticEngine.compute_values, batch)).abs().max().item()
    assert values_gap < MATCH


def test_weights_pushed_through_ray_reach_the_rollout_engine(ray_groups, prompts):
    state = ray_groups["actor"].run_all(ActorEngine.full_state_dict)[0]
    ray_groups["rollout"].run_all(Sampler.load_weight_bucket, state)
    ray_groups["rollout"].run_all(Sampler.finish_weight_sync)
    out = ray_groups["rollout"].run_split(Sampler.generate, prompts, 2, seed=3)
    assert len(out) == 2 * len(prompts)
    recomputed = ray_groups["actor"].run_split(ActorEngine.compute_logprobs, out)
    gap = (recomputed - out.sample_logprobs).abs()[out.response_mask.bool()].max().item()
    assert gap < SYNC_MATCH


def test_an_error_in_an_independent_replica_names_role_rank_and_error_and_keeps_the_group(ray_groups, prompts):
    from ppo_trainer.workers.roles import WorkerError

    with pytest.raises(WorkerError, match=r"rollout worker rank 0 of 1 failed in no_such_method: AttributeError"):
        ray_groups["rollout"].workers.submit("no_such_method", [()], {}).result()  # past the driver's check of method names
    assert len(ray_groups["rollout"].run_split(Sampler.generate, prompts.select([0]), 1, seed=0)) == 1


def test_a_failing_rank_is_reported_by_its_own_error_not_its_peers(ray_groups, batch):
    """Rank 1 rejects its rows at once; rank 0 is left waiting in FSDP's all-gather. The error is
    rank 1's, in seconds, and the stuck group is torn down."""
    from ppo_trainer.workers.roles import WorkerError

    broken = batch.select([1, 2]).with_fields(response_mask=None)
    start = time.monotonic()
    with pytest.raises(WorkerError) as e:
        ray_groups["actor"].workers.submit("compute_logprobs", [(batch.select([0, 3]),), (broken,)], {}).result()
    assert time.monotonic() - start < 30
    message = str(e.value)
    assert message.startswith("actor worker rank 1 of 2 failed in compute_logprobs: ValueError")
    assert "response_mask" in message
    with pytest.raises(WorkerError, match="down after an earlier failure"):
        ray_groups["actor"].run_all(ActorEngine.full_state_dict)


def test_a_call_past_the_worker_timeout_fails_naming_the_role_rank_and_method(ray_groups):
    """A rank stuck in a call (here a task that sleeps) cannot hang the run: past
    trainer.worker_timeout_s the call fails, and later calls on the group fail at once."""
    import ray

    from ppo_trainer.workers.cluster.backend import RayWorkers
    from ppo_trainer.workers.roles import WorkerError

    workers = RayWorkers.__new__(RayWorkers)  # its _gather over plain tasks: no real worker is harmed
    workers.role, workers.timeout_s, workers.hosts, workers.failure, workers.distributed = "critic", 2.0, [], None, True
    quick, stuck = ray.remote(lambda: 1), ray.remote(lambda: time.sleep(60))
    ray.get(quick.remote())  # a worker process for it now: on a busy machine starting one takes longer than 2 s
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"critic worker rank 1 of 0 did not return from update within "
                                          r"trainer.worker_timeout_s=2 s; its workers were stopped"):
        workers._gather([quick.remote(), stuck.remote()], "update")
    assert time.monotonic() - start < 20
    with pytest.raises(WorkerError, match="down after an earlier failure"):
        workers._gather([quick.remote()], "update")
