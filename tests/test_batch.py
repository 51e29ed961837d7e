"""Batch reshaping that follows the fields' column blocks: concatenating replicas' rollouts."""

from __future__ import annotations

import torch

from ppo_trainer.batch import Batch


def rollout(response_lens: list[int], pad_id: int = 7) -> Batch:
    """Prompts of 2 tokens, then responses of `response_lens` tokens, right-padded to the longest."""
    T = max(response_lens)
    mask = (torch.arange(T) < torch.tensor(response_lens)[:, None]).long()
    attention = torch.cat([torch.ones(len(response_lens), 2, dtype=torch.long), mask], dim=1)
    ids = torch.where(attention.bool(), 5, pad_id)
    return Batch(input_ids=ids, attention_mask=attention, position_ids=torch.arange(2 + T).repeat(len(response_lens), 1),
                 response_mask=mask, sample_logprobs=-mask.float(), scores=torch.ones(len(response_lens)),
                 meta={"pad_token_id": pad_id})


def test_concat_right_pads_every_response_field_to_the_widest():
    merged = Batch.concat([rollout([1]), rollout([3, 2])])
    assert merged.response_length == 3 and merged.prompt_length == 2
    assert merged.input_ids[0].tolist() == [5, 5, 5, 7, 7]
    assert merged.attention_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert merged.position_ids[0].tolist() == [0, 1, 2, 3, 4]
    assert merged.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert merged.sample_logprobs[0].tolist() == [-1.0, 0.0, 0.0]
    assert merged.scores.tolist() == [1.0, 1.0, 1.0]


def test_concat_left_pads_narrower_prompt_blocks_to_the_widest():
    """A multi-turn environment may replace prompts, so replicas' prompt blocks can differ in width."""
    narrow = rollout([1])  # 2 prompt columns
    wide = Batch(input_ids=torch.full((1, 5), 6), attention_mask=torch.ones(1, 5, dtype=torch.long),
                 position_ids=torch.arange(5)[None], response_mask=torch.ones(1, 1, dtype=torch.long),
                 sample_logprobs=torch.full((1, 1), -2.0), scores=torch.zeros(1), meta={"pad_token_id": 7})
    merged = Batch.concat([narrow, wide])
    assert merged.prompt_length == 4 and merged.response_length == 1
    assert merged.input_ids.tolist() == [[7, 7, 5, 5, 5], [6, 6, 6, 6, 6]]
    assert merged.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert merged.position_ids.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert merged.response_mask.tolist() == [[1], [1]] and merged.sample_logprobs.tolist() == [[-1.0], [-2.0]]


def test_per_token_versions_follow_the_response_block_through_concat_select_and_trim():
    """Partial rollouts' `token_version` [B, T] is a response field: padded with 0, cut with the block."""
    one, two = rollout([1]), rollout([3, 2])
    one = one.with_fields(token_version=torch.tensor([[4]]))
    two = two.with_fields(token_version=torch.tensor([[3, 3, 4], [3, 3, 0]]))
    merged = Batch.concat([one, two])
    assert merged.token_version.tolist() == [[4, 0, 0], [3, 3, 4], [3, 3, 0]]
    picked = merged.select([0, 2]).trim_padding()
    assert picked.response_length == 2 and picked.token_version.tolist() == [[4, 0], [3, 3]]
