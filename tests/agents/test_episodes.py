"""Episodes turn by turn: tool calls and environment steps run concurrently within tool_timeout_s;
a timeout, an exception or an unreadable result becomes an observation the policy sees and is
counted, never a crashed or hung run; the rows' tools_kwargs and extra_info reach the episode."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppo_trainer.agents import AgentInstanceBase, Episodes, ResetOutcome, load_tools
from ppo_trainer.agents.tools import Tool, function_schema
from ppo_trainer.config.schema import MultiTurnConfig
from ppo_trainer.models.tiny import build_tiny_tokenizer

RELEASE = threading.Event()  # set at the end of the module: the hung calls' threads finish


def hang(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    RELEASE.wait(seconds)
    return "woke"


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module", autouse=True)
def _release_hung_calls():
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tools():
    return [*load_tools(["calculator", "python"]), Tool("hang", function_schema(hang, "hang"), hang)]


def episodes(tokenizer, env_cls=None, tools=(), timeout=0.3, rows=1, extra_infos=None, **kwargs):
    """Episodes over `rows` prompts "p0", "p1", ... with label 4, reset."""
    eps = Episodes(MultiTurnConfig(tool_timeout_s=timeout, max_observation_tokens=1000), tokenizer, env_cls,
                   list(tools), **kwargs)
    eps.outcomes = eps.reset([f"p{i}" for i in range(rows)], [4] * rows, ["src"] * rows, extra_infos or [None] * rows)
    return eps


def user_turn(tokenizer, content):
    return tokenizer(f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"]


def test_a_timed_out_tool_becomes_an_error_observation_and_is_counted_while_the_others_answer(tokenizer, tools):
    eps = episodes(tokenizer, tools=tools, rows=2)
    start = time.monotonic()
    hung, fine = eps.step([0, 1], [call("hang", seconds=60) + call("calculator", expression="6*7"),
                                   call("calculator", expression="2+2")], ["p0", "p1"])
    assert time.monotonic() - start < 2
    assert hung.messages == [{"role": "tool", "name": "hang", "content": "Error: timed out after 0.3s"},
                             {"role": "tool", "name": "calculator", "content": "42"}]
    assert (hung.tool_calls, hung.tool_errors, hung.tool_timeouts, hung.done) == (2, 0, 1, False)
    assert tokenizer.decode(hung.observation_ids) == ("\n<|im_start|>tool\nError: timed out after 0.3s<|im_end|>\n"
                                                      "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert (fine.messages, fine.tool_timeouts) == ([{"role": "tool", "name": "calculator", "content": "4"}], 0)
    eps.close()


def test_hung_calls_of_many_episodes_share_one_deadline(tokenizer, tools):
    eps = episodes(tokenizer, tools=tools, rows=6)
    start = time.monotonic()
    outcomes = eps.step(list(range(6)), [call("hang", seconds=60)] * 6, ["p"] * 6)
    assert time.monotonic() - start < 1.5  # not 6 x 0.3 s
    assert [o.tool_timeouts for o in outcomes] == [1] * 6
    eps.close()


def test_unreadable_calls_unknown_tools_and_raising_tools_are_error_observations_and_counted(tokenizer, tools):
    eps = episodes(tokenizer, tools=tools, timeout=5)
    outcome, = eps.step([0], ["<tool_call>{oops</tool_call>" + call("search", q="x")
                              + call("calculator", expression="1/0") + call("calculator", text="1")], ["p0"])
    assert [m["content"] for m in outcome.messages] == [
        "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        "Error: there is no tool 'search' (tools: calculator, python, hang)",
        "Error: ValueError: division by zero",
        "Error: TypeError: calculator() got an unexpected keyword argument 'text'"]
    assert (outcome.tool_calls, outcome.tool_errors, outcome.tool_timeouts, outcome.done) == (4, 4, 0, False)
    eps.close()


def test_a_row_with_tools_kwargs_may_call_only_its_tools(tokenizer, tools):
    eps = episodes(tokenizer, tools=tools, timeout=5, rows=2,
                   extra_infos=[{"tools_kwargs": {"python": {"create_kwargs": {}}}}, None])
    limited, free = eps.step([0, 1], [call("calculator", expression="1+1")] * 2, ["p0", "p1"])
    assert limited.messages[0]["content"] == "Error: there is no tool 'calculator' (tools: python)"
    assert limited.tool_errors == 1 and free.messages[0]["content"] == "2" and free.tool_errors == 0
    eps.close()


def test_with_tools_only_an_answer_without_a_call_ends_the_episode(tokenizer, tools):
    eps = episodes(tokenizer, tools=tools)
    assert eps.step([0], ["It is 4."], ["p0"])[0].__dict__ == {
        "observation_ids": [], "observation_cut": False, "messages": [], "reward": 0.0, "done": True,
        "end_reason": "no_tool_call", "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "extra_logs": {},
        "sampling_params": None}


class Flaky(AgentInstanceBase):
    """Raises at its first step, answers at the next; async."""

    def __init__(self):
        self.steps = 0

    async def step(self, states):
        self.steps += 1
        if self.steps == 1:
            raise ValueError("boom")
        return {"rewards": 1.0, "environment_feedback": "ok", "done": True}


def test_a_raising_environment_becomes_an_error_observation_is_counted_and_the_episode_goes_on(tokenizer):
    eps = episodes(tokenizer, Flaky)
    first, = eps.step([0], ["it is 4"], ["p0"])
    error = "Error: environment step failed: ValueError: boom"
    assert (first.observation_ids, first.messages) == (user_turn(tokenizer, error),
                                                       [{"role": "environment", "content": error}])
    assert (first.tool_errors, first.tool_timeouts, first.done, first.reward) == (1, 0, False, 0.0)
    second, = eps.step([0], ["it is 4"], ["..."])
    assert (second.reward, second.done, second.end_reason, second.tool_errors) == (1.0, True, "env_done", 0)
    assert tokenizer.decode(second.observation_ids) == "ok"
    eps.close()


def test_an_unreadable_step_result_is_an_error_observation_too(tokenizer):
    class Wrong(AgentInstanceBase):
        def step(self, states):
            return {"rewards": "high"}

    outcome, = episodes(tokenizer, Wrong).step([0], ["a"], ["p0"])
    assert outcome.messages[0]["content"] == ("Error: environment step failed: step returned rewards=str 'high'; "
                                              "expected a finite number or a 0-d tensor")
    assert (outcome.tool_errors, outcome.done) == (1, False)


class Hung(AgentInstanceBase):
    """A sync step that never returns in time."""

    def step(self, states):
        RELEASE.wait(60)
        return {"done": True}


def test_an_environment_step_past_the_timeout_is_counted_and_ends_the_episode_at_once(tokenizer):
    eps = episodes(tokenizer, Hung)
    start = time.monotonic()
    outcome, = eps.step([0], ["a"], ["p0"])
    assert time.monotonic() - start < 2
    assert (outcome.done, outcome.end_reason, outcome.tool_timeouts, outcome.observation_ids) == (True, "env_error", 1,
                                                                                                  [])
    assert outcome.messages == [{"role": "environment", "content": "Error: environment step timed out after 0.3s"}]
    eps.close()


class Cancelled(AgentInstanceBase):
    """An async reset that waits forever, and notes that it was cancelled."""

    cancelled = threading.Event()

    async def reset(self, states):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            Cancelled.cancelled.set()
            raise

    async def step(self, states):
        return {}


def test_a_reset_past_the_timeout_is_cancelled_counted_and_the_episode_ends_at_its_first_environment_turn(tokenizer):
    eps = episodes(tokenizer, Cancelled)
    assert eps.outcomes == [ResetOutcome(None, "timed out after 0.3s", True)]
    assert Cancelled.cancelled.wait(5)
    outcome, = eps.step([0], ["a"], ["p0"])
    assert (outcome.done, outcome.end_reason, outcome.tool_timeouts, outcome.tool_errors) == (True, "env_error", 0, 0)
    assert outcome.messages == [{"role": "environment",
                                 "content": "Error: environment reset failed: timed out after 0.3s"}]
    eps.close()


def test_an_environment_that_cannot_be_built_is_an_error_at_reset_and_tools_still_answer(tokenizer, tools):
    class Broken(AgentInstanceBase):
        def __init__(self, extra_info):
            raise KeyError("interaction_kwargs")

        def step(self, states):
            return {}

    eps = episodes(tokenizer, Broken, tools=tools, timeout=5)
    assert eps.outcomes == [ResetOutcome(None, "KeyError: 'interaction_kwargs'", False)]
    by_tool, = eps.step([0], [call("calculator", expression="1+1")], ["p0"])
    assert (by_tool.messages[0]["content"], by_tool.done) == ("2", False)
    assert eps.step([0], ["4"], ["..."])[0].end_reason == "env_error"


def test_the_environment_gets_the_row_s_extra_info_and_may_change_the_prompt_and_the_sampling(tokenizer, tools):
    class Interaction:
        def __init__(self, data_source, extra_info):
            self.target = extra_info["interaction_kwargs"]["target"]
            self.source = data_source

        async def reset(self, states):
            return {"observation": f"{states['observation']} (find {self.target})"}

        def step(self, states):
            seen = states["sampling_params"]
            return {"rewards": float(self.target in states["action_text"]), "done": False,
                    "environment_feedback": f"{self.source}:{seen}", "sampling_params": {"temperature": 0.5}}

    eps = episodes(tokenizer, Interaction, tools=tools, timeout=5, extra_infos=[{"interaction_kwargs": {"target": "7"}}],
                   sampling_params={"temperature": 1.0, "max_tokens": 16})
    assert eps.outcomes == [ResetOutcome("p0 (find 7)")]
    first, = eps.step([0], ["7"], ["p0 (find 7)"])
    assert (first.reward, first.sampling_params) == (1.0, {"temperature": 0.5})
    assert first.messages[0]["content"] == "src:{'temperature': 1.0, 'max_tokens': 16}"
    second, = eps.step([0], [call("calculator", expression="3+4")], ["..."])  # a call goes to the tools
    assert (second.messages, second.reward) == ([{"role": "tool", "name": "calculator", "content": "7"}], 0.0)
    third, = eps.step([0], ["6"], ["..."])
    assert third.messages[0]["content"] == "src:{'temperature': 0.5, 'max_tokens': 16}"
    eps.close()


HUNG_AT_EXIT = """
import sys, time
sys.path.insert(0, {root!r})
from ppo_trainer.agents import AgentInstanceBase, Episodes
from ppo_trainer.config.schema import MultiTurnConfig
from ppo_trainer.models.tiny import build_tiny_tokenizer

class Stuck(AgentInstanceBase):
    def step(self, states):
        time.sleep(3600)

eps = Episodes(MultiTurnConfig(tool_timeout_s=0.2), build_tiny_tokenizer(), Stuck, [])
eps.reset(["p"], [1], [None], [None])
print(eps.step([0], ["a"], ["p"])[0].end_reason)
eps.close()
"""


def test_a_hung_environment_does_not_delay_the_exit(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG_AT_EXIT.format(root=str(Path(__file__).resolve().parents[2])))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "env_error"), done.stderr
    assert time.monotonic() - start < 30  # the import of transformers, not the hour the step sleeps
