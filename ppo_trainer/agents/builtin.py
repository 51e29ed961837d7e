"""The built-in tools, `sampler.multi_turn.tools=[calculator, python]`.

- calculator: arithmetic on numbers (+ - * / // % **, unary signs, parentheses) by walking the
  expression's syntax tree; nothing else is evaluated (no names, calls or attributes).
- python: the code runs in a fresh interpreter (`python -I -u`: no user site, no PYTHON* variables)
  in an empty temporary folder, with a wall clock (`tool_timeout_s`), an address-space limit
  (`python_memory_mb`), a 1 MiB limit on every file it writes, and an environment holding only
  PATH and the locale (no tokens or other secrets of the trainer's). It is a guard against
  accidents, not a security sandbox: the code runs as the trainer's user, may read what that user
  can read, and may use the network.
"""

from __future__ import annotations

import ast
import operator
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Union

Number = Union[int, float]

MAX_EXPONENT = 1000  # |b| in a ** b
MAX_INT_BITS = 4096  # an integer result larger than this is refused (the arithmetic stays fast)
MAX_EXPRESSION = 1000  # characters
OUTPUT_CHARS = 4000  # of the python tool's stdout and stderr; the observation is cut further to its token budget
FILE_LIMIT = 1 << 20  # bytes, every file the code writes (its output included)
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(3 + 4) * 2 ** 3".
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"not an arithmetic expression: {e.msg if isinstance(e, SyntaxError) else e}") from None
    return str(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> Number:
    """The value of one node of an arithmetic expression; ValueError for anything that is not
    arithmetic, a division by zero, an exponent over MAX_EXPONENT or an integer over MAX_INT_BITS."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and left.bit_length() * right > MAX_INT_BITS + right:
            raise ValueError("the result is too large")  # known before computing it
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic (only numbers, + - * / // % ** and parentheses)")


# Run in the child before the code: the limits (a process may lower its own), then the code itself,
# passed as the last argument so that no shell and no quoting stand between it and the interpreter.
_BOOTSTRAP = (
    "import resource, sys\n"
    "memory, files, code = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
    "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "del sys.argv[1:], memory, files, resource\n"
    "try:\n"
    "    exec(compile(code, '<python tool>', 'exec'), {'__name__': '__main__'})\n"
    "except SystemExit:\n"
    "    raise\n"
    "except BaseException as error:\n"  # the traceback from the code's own frames, the bootstrap's left out
    "    import traceback\n"
    "    traceback.print_exception(type(error), error, error.__traceback__.tb_next)\n"
    "    sys.exit(1)\n"
)


def python_tool(timeout_s: float, memory_mb: int) -> Callable[[str], str]:
    """The python tool with its limits bound: `timeout_s` of wall clock, `memory_mb` MiB of address space."""

    def python(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it prints (stdout and stderr).

        Args:
            code: The Python program; use print() to show results.
        """
        return run_python(code, timeout_s, memory_mb)

    return python


def run_python(code: str, timeout_s: float, memory_mb: int) -> str:
    """stdout and stderr of `code` run as described in the module's docstring, cut to
    OUTPUT_CHARS, with the exit status when it is not 0. TimeoutError past `timeout_s` (the code's
    whole process group is killed)."""
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    with tempfile.TemporaryDirectory(prefix="ppo-python-tool-") as folder:
        output_path = Path(folder) / ".output"
        with open(output_path, "wb") as output:
            process = subprocess.Popen(
                [sys.executable, "-I", "-u", "-c", _BOOTSTRAP, str(memory_mb << 20), str(FILE_LIMIT), code],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, cwd=folder, env=env,
                start_new_session=True)  # its own process group: a timeout kills what it started too
            try:
                status = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                raise TimeoutError(f"the python code ran past {timeout_s:g}s and was killed") from None
            finally:
                _kill_group(process)  # anything it left running in the background
        with open(output_path, "rb") as output:
            text = output.read(OUTPUT_CHARS * 4).decode("utf-8", errors="replace")
    cut = text[:OUTPUT_CHARS] + ("\n[output cut]" if len(text) > OUTPUT_CHARS else "")
    return cut + _status_note(status)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _status_note(status: int) -> str:
    """"" for success; else the exit code, or the signal that ended the process."""
    if status == 0:
        return ""
    if status < 0:
        try:
            return f"\n[killed by {signal.Signals(-status).name}]"
        except ValueError:
            return f"\n[killed by signal {-status}]"
    return f"\n[exit code {status}]"
