"""algorithm.pack_sequences through the engines: the actor's logprobs and entropies, the critic's
values, both losses, their statistics and gradients equal the padded rows' in float32, for every
layout (`models.packing`): prompts shared in 4D-masked blocks packed several to a row (sdpa, eager),
and single sequences packed and told apart by their positions alone (flash attention's layout;
here through sdpa, for which transformers builds the equivalent mask from the positions)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPT_LENS, RESPONSE_LENS, full_grads, make_actor, make_critic, random_batch

import ppo_trainer.models.packing as packing
from ppo_trainer.engine.microbatch import micro_batch_units

# float32: summation orders differ by a few ulps of the largest terms
ATOL = 1e-5
BUDGET = 64  # several micro-batches, each with room for several blocks per row

LAYOUTS = {  # name: (attention implementation, whether it takes 4D masks)
    "shared-sdpa": ("sdpa", True), "shared-eager": ("eager", True), "by-positions": ("sdpa", False),
}


@pytest.fixture(scope="module", params=[1, 4], ids=["own-prompts", "4-samples-per-prompt"])
def batch(request):
    """16 uneven rows, so that several blocks fit the longest one's width: their own prompts, or 4
    prompts of 4 samples (blocks of 24, 10, 9 and 8 tokens)."""
    if request.param == 1:
        return random_batch(PROMPT_LENS + PROMPT_LENS[::-1], RESPONSE_LENS + [5, 1, 9, 2, 2, 7, 1, 3])
    return random_batch([3] * 4 + [6] * 4 + [5] * 4 + [4] * 4, [12, 2, 3, 4] + [1] * 12, samples=4)


def run_engines(model_dir, batch, implementation: str, masked: bool, pack: bool, monkeypatch) -> dict:
    """Outputs and gradients of one actor and one critic step on `batch`; padded rows for pack=False
    and masked=False (no layout at all)."""
    monkeypatch.setattr(packing, "MASKED_ATTENTION", ("eager", "sdpa") if masked else ())
    rows_laid_out = []
    real_block_rows = packing.block_rows
    monkeypatch.setattr(packing, "block_rows", lambda *a: rows_laid_out.append(real_block_rows(*a)) or rows_laid_out[-1])
    alg = {"pack_sequences": pack, "entropy_coef": 0.01, "use_kl_loss": True}
    actor = make_actor(model_dir, BUDGET, attn_implementation=implementation, algorithm=alg)
    assert actor.policy.layout == packing.Layout(share_prompts=masked, pack=pack)
    out = dict(zip(("logprobs", "entropy"), actor.compute_logprobs_and_entropy(batch)))
    out["actor_stats"] = actor.backward_mini_batch(batch, actor.micro_batch_loss, BUDGET)
    out["actor_grads"] = full_grads(actor.module)
    critic = make_critic(model_dir, BUDGET, algorithm={"pack_sequences": pack})
    out["values"] = critic.compute_values(batch)
    out["critic_stats"] = critic.backward_mini_batch(batch, critic.micro_batch_loss, BUDGET)
    out["critic_grads"] = full_grads(critic.module)
    out["most_blocks_in_a_row"] = max((len(row) for rows in rows_laid_out for row in rows), default=0)
    return out


@pytest.fixture(scope="module")
def padded(tiny_model_dir, batch):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_engines(tiny_model_dir, batch, "sdpa", masked=False, pack=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_rows_give_the_padded_rows_outputs_losses_and_gradients(tiny_model_dir, batch, padded, layout,
                                                                      monkeypatch):
    implementation, masked = LAYOUTS[layout]
    packed = run_engines(tiny_model_dir, batch, implementation, masked, pack=True, monkeypatch=monkeypatch)
    assert packed["most_blocks_in_a_row"] >= 2, "some row holds several blocks"
    for key in ("logprobs", "entropy", "values"):
        torch.testing.assert_close(packed[key], padded[key], atol=ATOL, rtol=0, msg=lambda m: f"{key}: {m}")
    for key in ("actor_stats", "critic_stats"):
        assert packed[key].keys() == padded[key].keys()
        for name, value in padded[key].items():
            if name != "padding_share":
                assert packed[key][name] == pytest.approx(value, abs=ATOL), f"{key} {name}"
        assert packed[key]["padding_share"] < padded[key]["padding_share"]
    for key in ("actor_grads", "critic_grads"):
        assert packed[key].keys() == padded[key].keys()
        for name, grad in padded[key].items():
            torch.testing.assert_close(packed[key][name], grad, atol=ATOL * max(1.0, float(grad.abs().max())), rtol=0,
                                       msg=lambda m: f"{key} {name}: {m}")


def test_a_micro_batch_costs_its_packed_rows_times_the_longest_block():
    """Rows of (prompt, response) tokens (3, 12), (5, 2), (2, 3), (4, 4): padded 4 x (5 + 12); packed,
    first-fit decreasing into width 15: [15], [8, 7], [5]."""
    batch = random_batch([3, 5, 2, 4], [12, 2, 3, 4])
    rows = [0, 1, 2, 3]
    assert micro_batch_units(batch, packing.Layout()).cost(rows) == 4 * 17
    assert micro_batch_units(batch, packing.Layout(pack=True)).cost(rows) == 3 * 15
    assert packing.block_rows([15, 7, 5, 8], pack=True) == [[0], [3, 1], [2]]
    shared = random_batch([3, 3, 2, 2], [12, 2, 3, 4], samples=2)  # blocks 3 + 12 + 2, 2 + 3 + 4
    assert micro_batch_units(shared, packing.Layout(share_prompts=True)).cost(rows) == 2 * 17
    assert micro_batch_units(shared, packing.Layout(share_prompts=True, pack=True)).cost(rows) == 2 * 17  # 17 + 9 > 17
    assert micro_batch_units(batch, packing.Layout(pack=True)).needed(rows) == 15 + 7 + 5 + 8
    assert micro_batch_units(shared, packing.Layout(share_prompts=True)).needed(rows) == 17 + 9
