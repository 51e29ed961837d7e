"""GSM8K ground truth and prompt format."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_trainer.config import DataConfig
from ppo_trainer.data.datasets import format_prompt, ground_truth, user_message
from ppo_trainer.models.loading import load_tokenizer


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("48/2 = <<48/2=24>>24\n#### 72", "72"),
        ("#### 1,600", "1600"),
        ("#### -3", "-3"),
        ("first #### 4\nthen #### 5", "5"),
        ("42", "42"),
        ("  7.5 ", "7.5"),
    ],
)
def test_ground_truth_is_the_text_after_the_last_marker(answer: str, truth: str) -> None:
    assert ground_truth(answer) == truth


def test_ground_truth_of_an_empty_answer_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing after '####'"):
        ground_truth("reasoning\n####  ")


def test_user_message_fills_question_and_instruction() -> None:
    cfg = DataConfig()
    message = user_message("  What is 2 + 3?\n", cfg.prompt_template, cfg.instruction)
    assert message == 'What is 2 + 3? Let\'s think step by step and output the final answer after "####".'
    assert user_message("Q", "Question: {question}\n{instruction} {{ok}}", "Answer briefly.") == \
        "Question: Q\nAnswer briefly. {ok}"


def test_user_message_with_an_unknown_placeholder_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"data.prompt_template=.*only \{question\} and \{instruction\}"):
        user_message("Q", "{question} {answer}", "")


def test_format_prompt_opens_the_assistant_turn(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert format_prompt("Hi", tokenizer, use_chat_template=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt("Hi", tokenizer, use_chat_template=False) == "Hi"


def test_system_prompt_replaces_the_templates_default_system_turn() -> None:
    from ppo_trainer.models.loading import load_tokenizer as load

    tokenizer = load("embedded:smollm2-135m-instruct")  # its template adds a default system prompt
    default = format_prompt("Hi", tokenizer, use_chat_template=True)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert format_prompt("Hi", tokenizer, use_chat_template=True, system_prompt="") == \
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt("Hi", tokenizer, use_chat_template=True, system_prompt="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n")
