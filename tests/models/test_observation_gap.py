"""Multi-turn rows: observation tokens inside the response block (response_mask 0, attention 1)
are context, never predictions. The policy's logprobs and the critic's values of the policy's
tokens equal a plain forward of each whole row run alone, on the padded and the packed
(shared-prompt) paths; both are 0 on observation tokens."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.models import packing
from ppo_trainer.models.actor import CausalLMPolicy, load_causal_lm
from ppo_trainer.models.critic import ValueModel
from ppo_trainer.rollout.base import assemble_rollout, prompts_to_batch

A, B = [5, 9, 14, 3], [7, 8]  # two prompts; A has three episodes, B one
# (response tokens, mask): actions 1, observations 0; row 2 ends on an observation cut by the budget
EPISODES = [([20, 21, 40, 41, 42, 22, 23], [1, 1, 0, 0, 0, 1, 1]),
            ([24, 43, 25, 26], [1, 0, 1, 1]),
            ([27, 28, 29, 44, 45], [1, 1, 1, 0, 0]),
            ([30, 46, 47, 31], [1, 0, 0, 1])]


def gap_batch():
    """The rollout Batch of EPISODES, built by `assemble_rollout` as the multi-turn sampler builds it."""
    return assemble_rollout(prompts_to_batch([A, A, A, B], pad_id=0), 1, [ids for ids, _ in EPISODES],
                            [[-1.0] * len(ids) for ids, _ in EPISODES], [False] * 4, [""] * 4, 0,
                            response_masks=[mask for _, mask in EPISODES])


def alone(row: int) -> tuple[list[int], int]:
    """Row `row` unpadded (prompt then response) and its prompt length."""
    prompt = B if row == 3 else A
    return prompt + EPISODES[row][0], len(prompt)


@pytest.fixture(params=["padded", "packed"])
def path(request, monkeypatch):
    """The padded rows as they are, or packed by prompt (sdpa takes the 4D mask)."""
    if request.param == "padded":
        monkeypatch.setattr(packing, "MASKED_ATTENTION", ())
    return request.param


def test_the_gap_batch_attends_observations_and_counts_positions_through_them():
    batch = gap_batch()
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert batch.attention_mask[0, batch.prompt_length :].tolist() == [1] * 7
    assert batch.position_ids[0].tolist() == list(range(11))
    assert batch.position_ids[3].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.sample_logprobs[1].tolist() == [-1, 0, -1, -1, 0, 0, 0]
    assert len(batch.prompt_groups()) == 2  # rows 0-2 share a prompt: the packed path packs them


def test_policy_logprobs_and_entropies_over_an_observation_gap_equal_a_full_forward(tiny_model_dir, path):
    lm = load_causal_lm(str(tiny_model_dir))
    policy = CausalLMPolicy(lm, chunk_tokens=3).eval()
    batch = gap_batch()
    with torch.no_grad():
        logp, entropy = policy(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask,
                               temperature=0.7, with_entropy=True)
        for row, (ids, mask) in enumerate(EPISODES):
            tokens, P = alone(row)
            log_probs = torch.log_softmax(lm(input_ids=torch.tensor([tokens])).logits[0] / 0.7, dim=-1)
            for t, (token, trained) in enumerate(zip(ids, mask)):
                if trained:
                    expected = log_probs[P + t - 1]
                    torch.testing.assert_close(logp[row, t], expected[token], atol=1e-5, rtol=0)
                    torch.testing.assert_close(entropy[row, t], -(expected.exp() * expected).sum(), atol=1e-5, rtol=0)
                else:
                    assert logp[row, t] == 0 and entropy[row, t] == 0
            assert not logp[row, len(ids) :].any()


def test_values_over_an_observation_gap_equal_a_full_forward(tiny_model_dir, path):
    model = ValueModel.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        model.value_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        model.value_head.bias.fill_(0.25)
        batch = gap_batch()
        values = model(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask)
        for row, (ids, mask) in enumerate(EPISODES):
            tokens, P = alone(row)
            hidden = model.backbone(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            expected = model.value_head(hidden).squeeze(-1)
            for t, trained in enumerate(mask):
                if trained:  # V(s_t): the state before token t, an observation token's where one precedes it
                    torch.testing.assert_close(values[row, t], expected[P + t - 1], atol=1e-5, rtol=0)
                else:
                    assert values[row, t] == 0


def test_packing_keeps_observation_tokens_as_keys_of_their_own_episode():
    batch = gap_batch()
    packed = packing.pack_rows(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask,
                               packing.Layout(share_prompts=True))
    assert packed.input_ids[0].tolist() == A + EPISODES[0][0] + EPISODES[1][0] + EPISODES[2][0]
    assert packed.position_ids[0].tolist() == list(range(11)) + list(range(4, 8)) + list(range(4, 9))
    allowed = packed.attention_mask[0, 0]
    query = 4 + 5  # episode 0's token 22, after its observation 40, 41, 42
    assert allowed[query, :query + 1].tolist() == [True] * (query + 1)
    # the state before episode 1's token 25 is its observation 43's, at packed column 4 + 7 + 1
    assert (packed.predicting_rows[5].item(), packed.predicting_cols[5].item()) == (0, 12)
