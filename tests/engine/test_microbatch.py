"""Micro-batch planning: token budget, trimming of shared padding, dealing rows to ranks."""

from __future__ import annotations

import torch

from engine_cases import PROMPT_LENS, RESPONSE_LENS, random_batch
from ppo_trainer.engine.microbatch import global_counts, plan_micro_batches, split_by_token_budget


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
        groups = split_by_token_budget(batch, budget)
        assert sorted(torch.cat(groups).tolist()) == list(range(len(batch)))
        for rows in groups:
            micro = batch.select(rows).trim_padding()
            assert micro.input_ids.numel() <= budget  # rows x padded width
    assert len(split_by_token_budget(batch, 16)) > len(split_by_token_budget(batch, 100))


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    batch = random_batch([3, 2, 2], [12, 1, 1])
    groups = split_by_token_budget(batch, 8)
    assert [g.tolist() for g in groups] == [[0], [1, 2]]


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
