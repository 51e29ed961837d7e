"""Micro-batch planning: token budget, trimming of shared padding, dealing rows to ranks."""

from __future__ import annotations

import torch
from engine_cases import PROMPT_LENS, RESPONSE_LENS, random_batch

from ppo_trainer.batch import Batch
from ppo_trainer.engine.microbatch import global_counts, micro_batch_units, plan_micro_batches
from ppo_trainer.models.packing import Layout

SHARED = Layout(share_prompts=True)


def planned_rows(batch: Batch, budget: int, layout: Layout = Layout()) -> list[list[int]]:
    """The rows of each micro-batch one rank plans (no halving, no dummies: no other rank)."""
    return [m.rows.tolist() for m in plan_micro_batches(batch, budget, layout)]


def test_row_extents_count_real_prompt_and_response_tokens():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    prompt_lens, response_lens = batch.row_extents()
    assert prompt_lens.tolist() == PROMPT_LENS
    assert response_lens.tolist() == RESPONSE_LENS


def test_trim_padding_drops_only_columns_that_are_padding_in_every_row():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS).select([1, 2, 6])  # prompts 5,2,2; responses 2,3,1
    trimmed = batch.trim_padding()
    assert trimmed.prompt_length == 5 and trimmed.response_length == 3
    assert trimmed.input_ids.shape == (3, 8) and trimmed.advantages.shape == (3, 3)
    P = batch.prompt_length
    assert torch.equal(trimmed.input_ids, batch.input_ids[:, P - 5 : P + 3])
    assert torch.equal(trimmed.position_ids, batch.position_ids[:, P - 5 : P + 3])
    assert torch.equal(trimmed.response_mask, batch.response_mask[:, :3])
    assert trimmed.response_mask.sum() == batch.response_mask.sum()


def test_split_keeps_padded_tokens_within_budget_and_covers_every_row_once():
    batch = random_batch(PROMPT_LENS * 3, RESPONSE_LENS * 3)
    for budget in (16, 24, 40, 100):
        groups = planned_rows(batch, budget)
        assert sorted(sum(groups, [])) == list(range(len(batch)))
        for rows in groups:
            micro = batch.select(rows).trim_padding()
            assert micro.input_ids.numel() <= budget  # rows x padded width
    assert len(planned_rows(batch, 16)) > len(planned_rows(batch, 100))


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    batch = random_batch([3, 2, 2], [12, 1, 1])
    groups = planned_rows(batch, 8)
    assert groups == [[0], [1, 2]]


def test_deal_balances_tokens_and_gives_every_rank_a_row():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    shares = batch.deal(2)
    assert sorted(sum(shares, [])) == list(range(len(batch)))
    tokens = [int(batch.num_tokens()[s].sum()) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= max(batch.num_tokens()).item()
    assert all(len(s) >= 1 for s in batch.deal(8))
    assert batch.deal(2) == shares  # deterministic


def test_single_rank_plan_has_no_dummies_and_counts_are_local():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    micro = plan_micro_batches(batch, 16)
    assert not any(m.dummy for m in micro)
    assert sorted(torch.cat([m.rows for m in micro]).tolist()) == list(range(len(batch)))
    counts = global_counts(batch)
    assert counts.tokens == sum(RESPONSE_LENS) and counts.seqs == len(batch)


def test_rows_of_one_prompt_stay_together_and_packed_tokens_stay_within_budget():
    batch = random_batch(PROMPT_LENS * 3, RESPONSE_LENS * 3, samples=4)  # 6 prompts of 4 samples
    groups = batch.prompt_groups()
    assert groups == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    for budget in (24, 40, 100):
        split = planned_rows(batch, budget, SHARED)
        assert sorted(sum(split, [])) == list(range(len(batch)))
        for rows in split:
            assert all(set(g) <= set(rows) or not set(g) & set(rows) for g in groups)
            prompt_lens, response_lens = batch.select(rows).row_extents()
            packed = {}  # prompt -> packed row length, by hand
            for i, p, r in zip(rows, prompt_lens.tolist(), response_lens.tolist()):
                packed[i // 4] = packed.get(i // 4, p) + r
            if len(packed) > 1:  # a group over budget gets a micro-batch of its own
                assert len(packed) * max(packed.values()) <= budget
    padded = planned_rows(batch, 100)
    assert len(planned_rows(batch, 100, SHARED)) < len(padded)


def test_deal_keeps_a_prompts_rows_in_one_share_while_every_share_gets_one():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS, samples=2)  # 4 prompts of 2 samples
    for parts in (2, 4):
        shares = batch.deal(parts)
        assert sorted(sum(shares, [])) == list(range(len(batch)))
        assert all(len(s) % 2 == 0 and all(i + 1 in s for i in s if i % 2 == 0) for s in shares)
    assert all(len(s) == 1 for s in batch.deal(8))  # more shares than prompts: rows are dealt alone


def test_observation_tokens_count_in_a_forwards_cost_and_width_but_not_in_the_loss_counts():
    """A multi-turn row's observations (response_mask 0, attention 1) are computed, never trained:
    the micro-batch budget and trimming see them, the loss denominators do not."""
    batch = random_batch([3, 3], [6, 2], samples=2)
    gap = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]])  # row 0 ends on an observation
    batch = batch.with_fields(response_mask=gap)
    assert batch.row_extents()[1].tolist() == [6, 2]
    assert batch.trim_padding().response_length == 6
    assert global_counts(batch).tokens == 4
    assert micro_batch_units(batch, SHARED).cost([0, 1]) == 3 + 6 + 2  # one packed row
    assert planned_rows(batch, 2 * (3 + 6)) == [[0, 1]] and planned_rows(batch, 2 * (3 + 6) - 1) == [[0], [1]]
