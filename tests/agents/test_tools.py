"""sampler.multi_turn.tools: built-in and users' tools, their schemas and the loader's errors; the
calculator's arithmetic and the python tool's limits."""

from __future__ import annotations

import time

import pytest

from ppo_trainer.agents import allowed_tools, load_tools
from ppo_trainer.agents.builtin import calculator, run_python
from ppo_trainer.config.schema import ConfigError, MultiTurnConfig

USER_TOOLS = '''
def lookup(city: str, days: int = 1) -> str:
    """Look up the weather.

    Args:
        city: The city's name.
        days: How many days ahead.
    """
    return f"{city}: sunny for {days} days"


def no_hints(city):
    """Look up the weather.

    Args:
        city: The city's name.
    """


def no_docstring(city: str) -> str:
    return city


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_tools(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


def test_builtin_and_user_tools_get_their_openai_function_schemas(user_tools):
    calc, python, lookup = load_tools(["calculator", "python", f"{user_tools}:lookup"])
    assert [calc.name, python.name, lookup.name] == ["calculator", "python", "lookup"]
    assert lookup.schema["type"] == "function"
    assert lookup.schema["function"]["name"] == "lookup"
    assert lookup.schema["function"]["description"] == "Look up the weather."
    assert lookup.schema["function"]["parameters"] == {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "description": "The city's name."},
                       "days": {"type": "integer", "description": "How many days ahead."}}}
    assert calc.schema["function"]["parameters"]["required"] == ["expression"]
    assert python.schema["function"]["parameters"]["required"] == ["code"]
    assert lookup.fn("Oslo", days=2) == "Oslo: sunny for 2 days"


@pytest.mark.parametrize(("name", "message"), [
    ("no_hints", "'sampler.multi_turn.tools' element 1 ({ref!r}): no_hints has no function schema (Argument city is "
                 "missing a type hint"),
    ("no_docstring", "'sampler.multi_turn.tools' element 1 ({ref!r}): no_docstring has no function schema (Cannot "
                     "generate JSON schema for no_docstring because it has no docstring!)"),
    ("NOT_A_FUNCTION", "'sampler.multi_turn.tools' element 1 ({ref!r}): it is a int, not a function"),
    ("missing", "'sampler.multi_turn.tools' element 1 ({ref!r}): {path} has no function 'missing' (built-in tools: "
                "calculator, python)"),
])
def test_a_tool_without_a_schema_is_a_config_error_naming_the_key_the_element_and_what_is_missing(user_tools, name,
                                                                                                   message):
    ref = f"{user_tools}:{name}"
    with pytest.raises(ConfigError) as error:
        load_tools(["calculator", ref])
    assert str(error.value).startswith(message.format(ref=ref, path=user_tools))


def test_a_tool_named_twice_and_an_unknown_module_are_config_errors(user_tools):
    with pytest.raises(ConfigError, match="element 1 .* a tool named 'calculator' is listed twice"):
        load_tools(["calculator", "calculator"])
    with pytest.raises(ConfigError, match="element 0 .*module 'no_such_tools' cannot be imported"):
        load_tools(["no_such_tools:lookup"])
    with pytest.raises(ConfigError, match="expected 'module:function' or 'path/to/file.py:function'"):
        load_tools(["calculater"])


def test_a_row_with_tools_kwargs_may_call_only_the_tools_it_names():
    tools = load_tools(["calculator", "python"])
    assert [t.name for t in allowed_tools(tools, {"tools_kwargs": {"python": {"create_kwargs": {}}}})] == ["python"]
    assert [t.name for t in allowed_tools(tools, {"tools_kwargs": {}})] == []
    assert [t.name for t in allowed_tools(tools, {"index": 3})] == ["calculator", "python"]
    assert [t.name for t in allowed_tools(tools, None)] == ["calculator", "python"]


@pytest.mark.parametrize(("expression", "value"), [
    ("(3 + 4) * 2 ** 3", "56"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"), ("-(2.5)", "-2.5"),
    (" 1e3 + 1 ", "1001.0"), ("2 ** -1", "0.5"),
])
def test_the_calculator_does_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
    ("__import__('os').system('true')", "is not arithmetic"), ("x + 1", "'x' is not arithmetic"),
    ("True + 1", "'True' is not arithmetic"), ("2 ** 5000", "the exponent 5000 is larger than 1000"),
    ("(10 ** 1000) ** 1000", "the result is too large"), ("255 ** 1000", "the result is too large"),
    ("10.0 ** 999", "the result is too large"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic expression"), ("1" * 1001, "longer than 1000"),
])
def test_the_calculator_refuses_what_is_not_arithmetic_or_too_large(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_the_python_tool_returns_stdout_and_stderr_in_order_and_the_code_s_own_traceback():
    out = run_python("print('a')\nimport sys\nprint('b', file=sys.stderr)\n1/0", 10, 1024)
    assert out.startswith("a\nb\nTraceback (most recent call last):\n  File \"<python tool>\", line 4, in <module>\n")
    assert out.endswith("ZeroDivisionError: division by zero\n\n[exit code 1]")


def test_the_python_tool_inherits_no_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    names = run_python("import os; print(sorted(os.environ))", 10, 1024)
    assert "HF_TOKEN" not in names and "WANDB_API_KEY" not in names and "PATH" in names


def test_the_python_tool_is_killed_at_its_timeout_with_what_it_started():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 1s and was killed"):
        run_python("import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; "
                   "time.sleep(60)'])\ntime.sleep(60)", 1, 1024)
    assert time.monotonic() - start < 5


def test_the_python_tool_has_a_memory_limit_and_a_file_limit():
    assert "MemoryError" in run_python("x = bytearray(512 << 20)", 10, 256)
    assert run_python("x = bytearray(16 << 20); print(len(x))", 10, 256) == f"{16 << 20}\n"
    assert run_python("open('big', 'wb').write(bytes(2 << 20))", 10, 256).endswith(
        "OSError: [Errno 27] File too large\n\n[exit code 1]")


def test_the_python_tool_cuts_long_output():
    out = run_python("print('x' * 10000)", 10, 256)
    assert out == "x" * 4000 + "\n[output cut]"


def test_the_python_tool_takes_its_limits_from_the_config():
    python = load_tools(["python"], cfg=MultiTurnConfig(tool_timeout_s=0.5, python_memory_mb=128))[0].fn
    with pytest.raises(TimeoutError, match="ran past 0.5s"):
        python("while True: pass")
    assert "MemoryError" in python("x = bytearray(200 << 20)")
