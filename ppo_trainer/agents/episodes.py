"""The episodes of one multi-turn rollout call, turn by turn: what each assistant turn leads to.

Per episode and turn (`Episodes.step`):
1. the action has tool calls and tools are set: the calls run (concurrently, each bounded by
   `tool_timeout_s`) and their results, as `tool` turns through the chat template, are the next
   observation; a call that cannot be read, names a tool the row does not have, raises or times
   out gives an error text in its place (counted), and the episode goes on;
2. else, an environment is set: its `step` answers; its feedback, tokenized verbatim, is the next
   observation (OpenRLHF's semantics), with its reward (on the action's last token) and done;
3. else (tools only, an answer without a call): the episode is done ("no_tool_call").

What fails in the environment is never a crashed run. A step that raises or returns something
unreadable shows the policy one line naming the error, as a user turn through the template,
counted, and the episode goes on (the environment may recover, as a tool call may). A reset or step
past `tool_timeout_s` leaves its instance in an unknown state, its call perhaps still running: the
episode ends there ("env_error"), as it does at the first turn that needs an environment whose
construction or reset failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ppo_trainer.agents.calls import Result, Runner
from ppo_trainer.agents.environment import (
    init_keywords,
    load_environment,
    open_instance,
    read_step,
    reset_observation,
)
from ppo_trainer.agents.template import Observations, check_tool_template, parse_tool_calls
from ppo_trainer.agents.tools import Tool, ToolCall, allowed_tools, call_problem, load_tools, run_call
from ppo_trainer.config.schema import MultiTurnConfig


@dataclass(frozen=True)
class ResetOutcome:
    """How an episode starts: `observation`, the prompt text reset chose (None: the prompt as it
    is); `error`, one line when building or resetting the environment failed (the episode then
    ends at the first turn that needs it); `timeout`, whether that failure was a timeout. Counted
    as one environment error or one timeout."""

    observation: Optional[str] = None
    error: Optional[str] = None
    timeout: bool = False


@dataclass
class TurnOutcome:
    """What one assistant turn led to, for one episode."""

    observation_ids: list[int]  # appended after the action, within max_observation_tokens (may be empty)
    observation_cut: bool  # whether the observation was cut to max_observation_tokens
    messages: list[dict]  # the observation as chat turns for the records: tool turns, or one "environment" turn
    reward: float  # the environment's reward for this turn (0.0 when none); lands on the action's last token
    done: bool
    end_reason: Optional[str]  # when done: "env_done", "no_tool_call" or "env_error" (see the module); else None
    tool_calls: int  # calls parsed this turn
    tool_errors: int  # failed calls (unreadable, unknown tool, exception) + environment errors
    tool_timeouts: int  # tool calls and environment resets/steps that ran past tool_timeout_s
    extra_logs: dict[str, float]  # the environment's extra_logs and scores, numbers only
    sampling_params: Optional[dict]  # the environment's settings for the next turn: temperature, top_p, top_k, max_tokens


@dataclass
class _Episode:
    """One episode's state between turns."""

    label: Any
    tools: list[Tool]  # the tools its row allows
    instance: Any = None  # its environment, once reset succeeded
    broken: Optional[str] = None  # why its environment cannot be used (reset failed)
    sampling_params: dict = field(default_factory=dict)  # the settings its next turn samples with


class Episodes:
    """The episodes of one rollout call: one environment instance per episode (when an environment
    is set) and the tools each row allows. `reset` once, `step` per turn for the episodes still
    running, `close` at the end."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any, env_cls: Optional[type], tools: list[Tool], *,
                 sampling_params: Optional[dict] = None, chat_template_kwargs: Optional[dict] = None):
        """`sampling_params`: the sampler's settings (temperature, top_p, top_k, max_tokens) a step
        is shown until the environment changes them; `chat_template_kwargs`: data.chat_template_kwargs,
        for rendering tool turns as the prompts were rendered."""
        self.cfg = cfg
        self.env_cls = env_cls
        self.tools = tools
        self.observations = Observations(tokenizer, chat_template_kwargs)
        self.sampling_params = dict(sampling_params or {})
        self.runner = Runner()
        self.episodes: list[_Episode] = []

    def reset(self, prompts: list[str], labels: list[Any], data_sources: list[Optional[str]],
              extra_infos: list[Any]) -> list[ResetOutcome]:
        """One episode per prompt: its allowed tools (`tools.allowed_tools`), and with an
        environment an instance built and reset, all concurrently within `tool_timeout_s`."""
        self.episodes = [_Episode(label, allowed_tools(self.tools, extra), sampling_params=dict(self.sampling_params))
                         for label, extra in zip(labels, extra_infos)]
        if self.env_cls is None:
            return [ResetOutcome() for _ in prompts]
        calls = []
        for prompt, label, source, extra in zip(prompts, labels, data_sources, extra_infos):
            keywords = init_keywords(self.env_cls, {"data_source": source, "label": label, "extra_info": extra})
            calls.append(self.runner.start(
                lambda resolve, k=keywords, p=prompt, y=label: open_instance(self.env_cls, k, p, y, resolve)))
        outcomes = []
        for episode, prompt, result in zip(self.episodes, prompts, self.runner.wait(calls, self.cfg.tool_timeout_s)):
            error = result.error
            if error is None:
                episode.instance, value = result.value
                try:
                    outcomes.append(ResetOutcome(reset_observation(value, prompt)))
                    continue
                except ValueError as e:
                    error = str(e)
            episode.broken = f"environment reset failed: {error}"  # building the instance is part of its reset
            outcomes.append(ResetOutcome(None, error, result.timeout))
        return outcomes

    def step(self, indices: list[int], action_texts: list[str], observation_texts: list[str],
             closed: Optional[list[bool]] = None) -> list[TurnOutcome]:
        """What each episode's turn led to (see the module), every tool call and environment step of
        all of them running at once within `tool_timeout_s`. `action_texts`: the actions decoded
        (special tokens skipped, as OpenRLHF's environments get them); `observation_texts`: each
        episode's text so far, before the action; `closed`: whether each action's tokens end with the
        eos (None: all do), which decides whether a templated observation starts by closing the turn."""
        closed = closed or [True] * len(indices)
        plans = [self._plan(self.episodes[i], action) for i, action in zip(indices, action_texts)]
        calls = {}
        for n, (i, plan, action, seen) in enumerate(zip(indices, plans, action_texts, observation_texts)):
            episode = self.episodes[i]
            if plan == "env":
                states = {"observation_text": seen, "action_text": action, "label": episode.label,
                          "sampling_params": dict(episode.sampling_params)}
                calls[n] = [self.runner.start(lambda resolve, e=episode, s=states: resolve(e.instance.step(s)))]
            elif plan:
                calls[n] = [self.runner.start(lambda resolve, c=call, t=episode.tools: run_call(c, t, resolve))
                            for call in plan if call_problem(call, episode.tools) is None]
        started = [call for group in calls.values() for call in group]
        results = iter(self.runner.wait(started, self.cfg.tool_timeout_s))
        outcomes = []
        for n, (i, plan) in enumerate(zip(indices, plans)):
            ended = [next(results) for _ in calls.get(n, [])]
            if plan == "env":
                outcomes.append(self._env_turn(self.episodes[i], ended[0], closed[n]))
            elif plan:
                outcomes.append(self._tool_turn(self.episodes[i], plan, iter(ended), closed[n]))
            else:
                outcomes.append(self._end(self.episodes[i]))
        return outcomes

    def close(self) -> None:
        """Let go of the calls still running (abandoned daemon threads); nothing blocks the exit."""
        self.runner.close()

    def _plan(self, episode: _Episode, action: str) -> Any:
        """The turn's work: its tool calls (a non-empty list), "env" for a step, or None (no work:
        the episode ends)."""
        calls = parse_tool_calls(action) if self.tools else []
        if calls:
            return calls
        if self.env_cls is not None and episode.broken is None:
            return "env"
        return None

    def _end(self, episode: _Episode) -> TurnOutcome:
        """The turn that ends an episode with nothing to run: a broken environment, or no tool call."""
        if self.env_cls is not None:
            return _outcome([], False, [{"role": "environment", "content": f"Error: {episode.broken}"}],
                            done=True, end_reason="env_error")
        return _outcome([], False, [], done=True, end_reason="no_tool_call")

    def _tool_turn(self, episode: _Episode, plan: list[ToolCall], results: Any, closed: bool) -> TurnOutcome:
        """Tool turns, one per call in order: its result, or its error text."""
        messages, errors, timeouts = [], 0, 0
        for call in plan:
            problem = call_problem(call, episode.tools)
            result = Result(error=problem) if problem else next(results)
            errors += result.error is not None and not result.timeout
            timeouts += result.timeout
            content = result.value if result.error is None else f"Error: {result.error}"
            messages.append({"role": "tool", "name": call.name, "content": content})
        ids, shown, cut = self.observations.turns(messages, closed, self.cfg.max_observation_tokens)
        return _outcome(ids, cut, shown, tool_calls=len(plan), tool_errors=errors, tool_timeouts=timeouts)

    def _env_turn(self, episode: _Episode, result: Result, closed: bool) -> TurnOutcome:
        """The environment's answer to the action, or its error (see the module)."""
        if result.timeout:
            episode.broken = f"environment step {result.error}"  # never called again: its step may still run
            return _outcome([], False, [{"role": "environment", "content": f"Error: environment step {result.error}"}],
                            done=True, end_reason="env_error", tool_timeouts=1)
        error = result.error
        if error is None:
            try:
                step = read_step(result.value)
            except ValueError as e:
                error = str(e)
            else:
                ids, cut = self.observations.verbatim(step.feedback, self.cfg.max_observation_tokens)
                episode.sampling_params.update(step.sampling_params or {})
                return _outcome(ids, cut, [{"role": "environment", "content": step.feedback}], step.reward, step.done,
                                "env_done" if step.done else None, extra_logs=step.extra_logs,
                                sampling_params=step.sampling_params)
        shown = [{"role": "user", "content": f"Error: environment step failed: {error}"}]
        ids, shown, cut = self.observations.turns(shown, closed, self.cfg.max_observation_tokens)
        return _outcome(ids, cut, [{"role": "environment", "content": shown[0]["content"]}], tool_errors=1)


def _outcome(ids: list[int], cut: bool, messages: list[dict], reward: float = 0.0, done: bool = False,
             end_reason: Optional[str] = None, *, tool_calls: int = 0, tool_errors: int = 0, tool_timeouts: int = 0,
             extra_logs: Optional[dict] = None, sampling_params: Optional[dict] = None) -> TurnOutcome:
    return TurnOutcome(ids, cut, messages, reward, done, end_reason, tool_calls, tool_errors, tool_timeouts,
                       extra_logs or {}, sampling_params)


def load_multi_turn(cfg: MultiTurnConfig, tokenizer: Any,
                    chat_template_kwargs: Optional[dict] = None) -> tuple[Optional[type], list[Tool]]:
    """The environment class and the tools `sampler.multi_turn` names, and the check that the
    model's chat template can carry the tools: every problem a ConfigError naming its key, raised
    where the run starts (the driver, ppo-eval), before any model loads."""
    env_cls = None if cfg.env is None else load_environment(cfg.env)
    tools = load_tools(list(cfg.tools), cfg=cfg)
    check_tool_template(tokenizer, tools, chat_template_kwargs=chat_template_kwargs)
    return env_cls, tools
