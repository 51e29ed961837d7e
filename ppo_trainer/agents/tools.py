"""The tools the policy may call (`sampler.multi_turn.tools`): built-in ones by name, users'
functions by reference, each with the OpenAI function schema that transformers makes of its type
hints and docstring (`get_json_schema`) and the chat template shows the model. Also which tools a
data row allows (verl's `extra_info.tools_kwargs`) and how one parsed call becomes its result text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ppo_trainer.agents.builtin import calculator, python_tool
from ppo_trainer.config.schema import ConfigError, MultiTurnConfig
from ppo_trainer.rewards.calling import import_attribute

BUILTIN = ("calculator", "python")


@dataclass(frozen=True)
class Tool:
    """One tool: its name (the function's), its OpenAI function schema
    ({"type": "function", "function": {"name", "description", "parameters"}}) and the function."""

    name: str
    schema: dict
    fn: Callable[..., Any]


def load_tools(refs: list[str], key: str = "sampler.multi_turn.tools",
               cfg: Optional[MultiTurnConfig] = None) -> list[Tool]:
    """The tools `refs` name: "calculator" and "python" (built in; the python tool's limits from
    `cfg`, the schema's defaults when None), else "module:function" or "path/to/file.py:function".
    ConfigError naming `key`, the element and what is missing: a function that cannot be imported,
    one without type hints for every parameter or a docstring describing each (no schema), or two
    tools of one name."""
    cfg = cfg or MultiTurnConfig()
    tools: list[Tool] = []
    for index, ref in enumerate(refs):
        where = f"'{key}' element {index} ({ref!r})"
        if ref == "calculator":
            fn = calculator
        elif ref == "python":
            fn = python_tool(cfg.tool_timeout_s, cfg.python_memory_mb)
        else:
            try:
                fn = import_attribute(ref, "function", "my_tools.py:lookup")
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"{where}: {e} (built-in tools: {', '.join(BUILTIN)})") from None
            if not callable(fn):
                raise ConfigError(f"{where}: it is a {type(fn).__name__}, not a function")
        tool = Tool(getattr(fn, "__name__", ref), function_schema(fn, where), fn)
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"{where}: a tool named '{tool.name}' is listed twice; the model calls tools by name")
        tools.append(tool)
    return tools


def function_schema(fn: Callable[..., Any], where: str) -> dict:
    """`fn`'s OpenAI function schema by transformers' `get_json_schema`; ConfigError starting with
    `where` that says what the function lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException, or a signature error
        raise ConfigError(f"{where}: {getattr(fn, '__name__', fn)} has no function schema ({e}); a tool needs a type "
                          "hint on every parameter and a docstring whose Args: section describes each") from None


def allowed_tools(tools: list[Tool], extra_info: Any) -> list[Tool]:
    """The tools a row may call: those its `extra_info["tools_kwargs"]` names (verl's per-row tool
    list, a dict keyed by tool name) when it has one, else all of them."""
    names = _row_tool_names(extra_info)
    return list(tools) if names is None else [t for t in tools if t.name in names]


def _row_tool_names(extra_info: Any) -> Optional[set[str]]:
    if isinstance(extra_info, Mapping) and isinstance(extra_info.get("tools_kwargs"), Mapping):
        return {str(name) for name in extra_info["tools_kwargs"]}
    return None


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the assistant's text: the tool's name and its arguments, or why it
    could not be read (`error`, one line)."""

    name: str = ""
    arguments: Optional[dict] = None
    error: Optional[str] = None


def read_call(payload: str) -> ToolCall:
    """A call's JSON, {"name": ..., "arguments": {...}} ("arguments" may be a JSON string of the
    object, as some models write it; "parameters" is read as "arguments")."""
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(error='the tool call needs a "name" (text) and "arguments" (an object)')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f'the "arguments" of {value["name"]} are not an object')
    return ToolCall(value["name"], arguments)


def call_problem(call: ToolCall, tools: list[Tool]) -> Optional[str]:
    """Why `call` is not run (unreadable, or a tool the row does not have), or None."""
    if call.error:
        return call.error
    if not any(t.name == call.name for t in tools):
        offered = ", ".join(t.name for t in tools) or "none"
        return f"there is no tool '{call.name}' (tools: {offered})"
    return None


def run_call(call: ToolCall, tools: list[Tool], resolve: Callable[[Any], Any]) -> str:
    """The result text of a call `call_problem` let through: the function's return value as text
    (a string as it is, anything else as JSON). An async tool is awaited through `resolve`."""
    fn = next(t.fn for t in tools if t.name == call.name)
    value = resolve(fn(**call.arguments))
    return value if isinstance(value, str) else json.dumps(value, default=str)
