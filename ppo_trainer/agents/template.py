"""Tools through the model's chat template: the prompt that offers them, the calls read back from
the assistant's text, and the tool results rendered as the template writes a tool turn.

Recognised call format: Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call (Qwen2.5, Qwen3, Hermes and the models trained on their templates). A template that
ignores `tools` (it renders the same text with and without them; the embedded SmolLM2's and the
tiny test model's do) gets the schemas and the Hermes format in its system message instead. A
template that shows tools in another format (Llama 3.1's JSON, Mistral's [TOOL_CALLS]) is refused
when the config loads: its calls would never be read.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from ppo_trainer.agents.tools import Tool, ToolCall, read_call
from ppo_trainer.config.schema import ConfigError

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # an unclosed last block (a cut turn) too
_PROBE_USER = {"role": "user", "content": "?"}
_PROBE_ASSISTANT = {"role": "assistant", "content": "x"}


def tools_system_text(schemas: list[dict]) -> str:
    """The tool section a system message gets when the template ignores `tools`: the schemas and
    the Hermes call format, worded as Hermes-style templates word them."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_prompt_with_tools(tokenizer: Any, messages: list[dict], tools: list[Tool],
                             chat_template_kwargs: Optional[dict] = None,
                             in_system: Optional[bool] = None) -> tuple[str, bool]:
    """(prompt text, whether the tools went into the system message). The chat template renders
    `messages` with the assistant turn opened and `tools=` their schemas; when that gives the text it
    gives without them (the template ignores tools), the schemas and the Hermes call format are put
    into the system message instead (appended to the conversation's own, else a new first turn),
    which the caller says once on the console. `in_system`: that decision when the caller made it
    once for all its prompts (`template_ignores_tools`); None decides it on `messages`."""
    kwargs = dict(chat_template_kwargs or {})
    if not tools:
        return _render(tokenizer, messages, True, kwargs), False
    schemas = [tool.schema for tool in tools]
    if in_system is None:
        in_system = template_ignores_tools(tokenizer, tools, kwargs, messages)
    if not in_system:
        return _render(tokenizer, messages, True, {**kwargs, "tools": schemas}), False
    return _render(tokenizer, with_tools_system(messages, schemas), True, kwargs), True


def template_ignores_tools(tokenizer: Any, tools: list[Tool], chat_template_kwargs: Optional[dict] = None,
                           messages: Optional[list[dict]] = None) -> bool:
    """Whether the chat template renders `messages` (a one-question probe by default) the same with
    and without `tools=` their schemas: then the tools must go into the system message."""
    kwargs = dict(chat_template_kwargs or {})
    probe = messages or [_PROBE_USER]
    return _render(tokenizer, probe, True, kwargs) == _render(tokenizer, probe, True,
                                                              {**kwargs, "tools": [t.schema for t in tools]})


def with_tools_system(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """`messages` with `tools_system_text` ending the system turn (a new first turn if there is none)."""
    section = tools_system_text(schemas)
    if messages and messages[0]["role"] == "system":
        own = messages[0]["content"]
        return [{**messages[0], "content": f"{own}\n\n{section}" if own.strip() else section}, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def check_tool_template(tokenizer: Any, tools: list[Tool], key: str = "sampler.multi_turn.tools",
                        chat_template_kwargs: Optional[dict] = None) -> None:
    """ConfigError naming `key` when the model's chat template cannot carry the tools: it shows
    tools in a format other than Hermes, or it cannot render a tool turn after an assistant turn.
    Run once when the config loads, before any model does."""
    if not tools:
        return
    kwargs = dict(chat_template_kwargs or {})
    shown = _render(tokenizer, [_PROBE_USER], True, {**kwargs, "tools": [t.schema for t in tools]})
    if shown != _render(tokenizer, [_PROBE_USER], True, kwargs) and "<tool_call>" not in shown:
        raise ConfigError(f"'{key}' is set, but the model's chat template asks for tool calls in a format other than "
                          "Hermes <tool_call>{json}</tool_call>, the one the trainer reads; use a model whose template "
                          "writes Hermes calls (Qwen2.5, Qwen3) or one that ignores tools (see docs/multi-turn.md)")
    try:
        Observations(tokenizer, kwargs).text([{"role": "tool", "name": tools[0].name, "content": "1"}], closed=True)
    except ValueError as e:
        raise ConfigError(f"'{key}' is set, but {e}") from None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes calls in an assistant's text, in order; a block whose JSON cannot be read is a
    call with its `error` set."""
    return [read_call(payload.strip()) for payload in _CALL.findall(text)]


class Observations:
    """Observations as token ids appended after an assistant turn. Chat turns (tool results, an
    error shown to the policy) are rendered by the template: the text it writes after the assistant
    turn's end-of-turn token (the tokenizer's eos) up to and including the next assistant header.
    That text begins with the eos itself, dropped when the action already ended with it (`closed`):
    the turn then goes on with what the template puts between turns (ChatML's newline)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})

    def text(self, messages: list[dict], closed: bool) -> str:
        """The text the template writes for `messages` after an assistant turn (see the class).
        ValueError when the template refuses the turns or renders the earlier turns differently."""
        prefix = _render(self.tokenizer, [_PROBE_USER, _PROBE_ASSISTANT], False, self.kwargs)
        full = _render(self.tokenizer, [_PROBE_USER, _PROBE_ASSISTANT, *messages], True, self.kwargs)
        eos = self.tokenizer.eos_token or ""
        split = prefix.rfind(eos) if eos and eos in prefix else len(prefix)
        if not full.startswith(prefix[:split]):
            raise ValueError("the model's chat template renders the turns before a tool turn differently with it, so a "
                             "tool turn cannot be appended to a conversation")
        text = full[split:]
        return text[len(eos):] if closed and eos and text.startswith(eos) else text

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def turns(self, messages: list[dict], closed: bool, max_tokens: int) -> tuple[list[int], list[dict], bool]:
        """(ids, the messages as shown, whether they were cut) for chat turns within `max_tokens`: when
        too long, each turn's content keeps its first tokens, an equal share of what the template's own
        text leaves, so that the next assistant header stays; a hard cut only if even that is too long."""
        ids = self.ids(self.text(messages, closed))
        if len(ids) <= max_tokens:
            return ids, messages, False
        frame = len(self.ids(self.text([{**m, "content": ""} for m in messages], closed)))
        share = max(0, (max_tokens - frame) // len(messages))
        shortened = [{**m, "content": self.tokenizer.decode(self.ids(m["content"])[:share])} for m in messages]
        return self.ids(self.text(shortened, closed))[:max_tokens], shortened, True

    def verbatim(self, text: str, max_tokens: int) -> tuple[list[int], bool]:
        """(ids, whether cut): an environment's feedback tokenized as it is (OpenRLHF's semantics),
        its first `max_tokens` tokens kept."""
        ids = self.ids(text)
        return ids[:max_tokens], len(ids) > max_tokens


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, kwargs: dict) -> str:
    """The template's text of `messages`; ValueError naming the roles when the template refuses them."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)
    except Exception as e:  # the template is the model's own code: jinja errors, its raise_exception(...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        roles = ", ".join(m["role"] for m in messages)
        raise ValueError(f"the model's chat template refuses these turns (roles: {roles}): {reason}") from None
