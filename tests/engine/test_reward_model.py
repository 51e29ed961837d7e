"""The reward model engine: each row rendered in the reward model's own template and tokens, scored
as a plain transformers forward of that text scores it, in token-budget micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_trainer.engine.reward_model import RewardModelEngine, token_budget_groups
from ppo_trainer.models.tiny import REWARD_DIGIT, build_tiny_reward_model, build_tiny_tokenizer

PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a digit."}]]
RESPONSES = ["3 + 4 = 7", "eight", "7", "The answer is #### 8", "x" * 40, "17"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward"))


def rows(n: int = len(RESPONSES)) -> tuple[list, list[str]]:
    return [PROMPTS[i % 2] for i in range(n)], RESPONSES[:n]


def plain_scores(folder: Path, dtype: torch.dtype) -> list[float]:
    """One unpadded forward per conversation, as transformers' documentation would have it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).eval()
    out = []
    for i, response in enumerate(RESPONSES):
        text = tokenizer.apply_chat_template([*PROMPTS[i % 2], {"role": "assistant", "content": response}],
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(model(**ids).logits[0, 0].float().item())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_equal_a_plain_transformers_forward_of_the_rendered_text(reward_model_dir, dtype):
    """Micro-batches of 2-3 padded rows (a 64-token budget) against one unpadded forward per row.
    Tolerance: float32 sums round at ~1e-6 of |score| <= 1; bfloat16 keeps 8 mantissa bits (2^-8)."""
    engine = RewardModelEngine(reward_model_dir, dtype=dtype, token_budget=64)
    expected = plain_scores(reward_model_dir, getattr(torch, dtype))
    got = engine.score_texts(*rows())
    tolerance = 1e-5 if dtype == "float32" else 2**-7
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, abs=tolerance)
    assert got.tolist() == pytest.approx([1.0 if r.endswith(REWARD_DIGIT) else 0.0 for r in RESPONSES], abs=tolerance)


def test_the_reward_model_uses_its_own_tokenizer_not_the_policys(reward_model_dir):
    """The tiny reward model numbers its characters in reverse: the policy's ids of the same text
    differ, and the score follows the reward model's reading of the text."""
    engine = RewardModelEngine(reward_model_dir, dtype="float32")
    policy = build_tiny_tokenizer()
    assert engine.tokenizer.convert_tokens_to_ids(REWARD_DIGIT) != policy.convert_tokens_to_ids(REWARD_DIGIT)
    ids = engine.token_ids(PROMPTS[0], "7")
    assert engine.tokenizer.decode(ids) == "What is 3 + 4?7"  # its own template: the turns' contents
    assert engine.score_texts(*rows(3))[2].item() == pytest.approx(1.0, abs=1e-5)


def test_a_tokenizer_without_a_chat_template_scores_the_question_answer_pair(reward_model_dir):
    engine = RewardModelEngine(reward_model_dir, dtype="float32")
    engine.tokenizer.chat_template = None
    assert engine.tokenizer.decode(engine.token_ids(PROMPTS[1], "7")) == "Say a digit.7"


def test_token_budget_groups_pack_similar_lengths_and_run_a_long_row_alone():
    assert token_budget_groups([5, 30, 6, 4, 29], budget=60) == [[1, 4], [2, 0, 3]]
    assert token_budget_groups([100, 3], budget=50) == [[0], [1]]
