"""GSM8K conventions: the ground truth of an answer (worked reasoning ending in "#### N": N), and
the prompt shown to the model (`data.prompt_template` in the chat template, assistant turn opened).
"""

from __future__ import annotations

from typing import Any, Optional

from ppo_trainer.rewards.math import ANSWER_MARKER


def ground_truth(answer: str) -> str:
    """The text after the last "####", commas and surrounding space stripped; an answer without the
    marker is taken whole (an answer column of bare numbers). ValueError if nothing is left."""
    truth = answer.rpartition(ANSWER_MARKER)[2].replace(",", "").strip()
    if not truth:
        raise ValueError(f"answer has nothing after '{ANSWER_MARKER}'")
    return truth


def user_message(question: str, template: str, instruction: str) -> str:
    """The user turn: `template` with {question} and {instruction} filled in; ValueError naming
    `data.prompt_template` if it has another placeholder."""
    try:
        return template.format(question=question.strip(), instruction=instruction)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"data.prompt_template={template!r} cannot be filled ({type(e).__name__}: {e}); "
            "it may use only {question} and {instruction} (write literal braces as {{ }})"
        ) from None


def format_prompt(message: str, tokenizer: Any, use_chat_template: bool, system_prompt: Optional[str] = None) -> str:
    """The prompt text the model continues: the chat template with the generation prompt added
    (after a system turn of `system_prompt` unless it is None: then the template's default), or
    the bare message when `use_chat_template` is False."""
    if not use_chat_template:
        return message
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return tokenizer.apply_chat_template(
        [*system, {"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
