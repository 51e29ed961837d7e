"""Prompt format: the user turn of a string prompt, the system turn, message prompts, the template's
own kwargs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_trainer.config.schema import DataConfig
from ppo_trainer.data import DataError
from ppo_trainer.data.datasets import chat_messages, render_prompt, user_message
from ppo_trainer.models.loading import load_tokenizer


def test_user_message_fills_question_and_instruction() -> None:
    cfg = DataConfig()
    message = user_message("  What is 2 + 3?\n", cfg.prompt_template, cfg.instruction)
    assert message == 'What is 2 + 3? Let\'s think step by step and output the final answer after "####".'
    assert user_message("Q", "Question: {question}\n{instruction} {{ok}}", "Answer briefly.") == \
        "Question: Q\nAnswer briefly. {ok}"


def test_user_message_with_an_unknown_placeholder_names_the_key() -> None:
    with pytest.raises(DataError, match=r"data.prompt_template=.*only \{question\} and \{instruction\}"):
        user_message("Q", "{question} {answer}", "")


def test_render_prompt_opens_the_assistant_turn(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    turns = [{"role": "user", "content": "Hi"}]
    assert render_prompt(turns, tokenizer, use_chat_template=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(turns, tokenizer, use_chat_template=False) == "Hi"


def test_string_prompts_get_template_instruction_and_system_prompt_message_prompts_do_not() -> None:
    cfg = DataConfig(prompt_template="Q: {question} ({instruction})", instruction="be brief", system_prompt="Sys.")
    assert chat_messages("2 + 2?", cfg) == [{"role": "system", "content": "Sys."},
                                             {"role": "user", "content": "Q: 2 + 2? (be brief)"}]
    turns = [{"role": "user", "content": "2 + 2?"}]
    assert chat_messages(turns, cfg) == [{"role": "system", "content": "Sys."}, {"role": "user", "content": "2 + 2?"}]
    own = [{"role": "system", "content": "Data's own."}, {"role": "user", "content": "2 + 2?"}]
    assert chat_messages(own, cfg) == own  # a system turn in the data wins over data.system_prompt
    assert chat_messages(turns, DataConfig()) == turns  # system_prompt None: the template's default


def test_a_message_prompt_without_the_chat_template_is_refused() -> None:
    with pytest.raises(ValueError, match="set data.use_chat_template=true"):
        chat_messages([{"role": "user", "content": "Hi"}], DataConfig(use_chat_template=False))


def test_system_prompt_replaces_the_templates_default_system_turn() -> None:
    tokenizer = load_tokenizer("embedded:smollm2-135m-instruct")  # its template adds a default system prompt
    user = {"role": "user", "content": "Hi"}
    default = render_prompt(chat_messages("Hi", DataConfig(prompt_template="{question}")), tokenizer, True)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    empty = chat_messages([user], DataConfig(system_prompt=""))
    assert render_prompt(empty, tokenizer, True) == \
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    brief = render_prompt(chat_messages([user], DataConfig(system_prompt="Be brief.")), tokenizer, True)
    assert brief.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}A:")
    turns = [{"role": "user", "content": "Hi"}]
    assert render_prompt(turns, tokenizer, True) == "user: Hi\nA:"
    assert render_prompt(turns, tokenizer, True, {"enable_thinking": False}) == "user: Hi\n<no_think>A:"
