"""Multi-turn rollouts: the policy acts, an environment or its tools answer (`ppo_trainer.agents`),
and the policy acts again on everything so far, until the episode ends. The episodes of a batch
advance turn by turn together: each turn continues every running episode's context (prompt and
all turns so far) in one `ContinuingSampler.complete` call, then steps all their environments.

One row per episode, one response block per row (`base` describes the layout):

    prompt | action 1 | observation 1 | action 2 | observation 2 | action 3 | pad
    mask     1 ... 1    0 ....... 0     1 ... 1    0 ....... 0     1 ... 1    0

Actions are the policy's tokens (response_mask 1: logprobs, values, advantages, every loss);
observations sit in the context (attention 1, positions counting on) with response_mask 0, so
nothing is trained on them and GAE passes over them (`core.gae`). A turn's environment reward
lands on its action's last token (`turn_rewards`).

Budgets end an episode and name the reason (`END_REASONS`): the environment (done: env_done, or
no_tool_call when the policy called no tool, or env_error when it failed), `multi_turn.max_turns` actions, and
`multi_turn.max_response_tokens` for the whole block (an observation that does not fit is cut and
ends the episode). Each action gets at most `sampler.max_new_tokens` (or the call's) tokens, and
never more than the block has left.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from statistics import mean
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.derived import response_budget
from ppo_trainer.config.schema import SamplerConfig
from ppo_trainer.rollout.base import (
    Completion,
    ContinuingSampler,
    RowSampling,
    assemble_rollout,
    prompt_token_lists,
)

if TYPE_CHECKING:
    from ppo_trainer.agents import Episodes, TurnOutcome

END_REASONS = ("env_done", "no_tool_call", "env_error", "max_turns", "max_response_tokens")


@dataclass
class Episode:
    """One row's episode as it grows: its prompt, the response block so far (tokens, mask,
    logprobs), the turns' rewards and what the environment reported."""

    prompt_ids: list[int]
    new_prompt: bool  # reset replaced the data's prompt
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on actions, 0 on observations
    logprobs: list[float] = field(default_factory=list)
    versions: Optional[list[int]] = None  # partial rollouts: each token's policy version, 0 on observations
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (column of an action's last token, reward)
    texts: list[str] = field(default_factory=list)  # the response block's text, segment by segment
    turns: list[dict[str, str]] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    logs: dict[str, list[float]] = field(default_factory=dict)  # extra_logs, per name one value per turn
    overrides: dict[str, Any] = field(default_factory=dict)  # the environment's sampling_params for the next turn
    last_stopped: bool = True  # the last action ended on EOS or a stop string
    end: Optional[str] = None  # one of END_REASONS once over

    @property
    def context(self) -> list[int]:
        """What the policy continues: the prompt and every turn so far."""
        return self.prompt_ids + self.ids

    @property
    def truncated(self) -> bool:
        """Cut short: the block ran out, or the last action hit its max_new_tokens without EOS."""
        return self.end == "max_response_tokens" or not self.last_stopped

    def sampling(self, max_new_tokens: int, budget: int, temperature: Optional[float]) -> RowSampling:
        """The next action's settings: the environment's overrides over the call's, at most the
        tokens left in the block (>= 1 while the episode runs)."""
        o = self.overrides
        return RowSampling(min(o.get("max_tokens", max_new_tokens), budget - len(self.ids)),
                           o.get("temperature", temperature), o.get("top_p"), o.get("top_k"))

    def add_turn(self, action: Completion, outcome: "TurnOutcome", last_turn: bool, budget: int,
                 decode: Callable[[list[int]], str]) -> None:
        """Append one action and what the environment answered; end the episode if it is over.
        A done episode or its last turn keeps the observation in `turns` only: no action follows
        it in the block."""
        self.ids += action.token_ids
        self.mask += [1] * len(action.token_ids)
        self.logprobs += action.logprobs
        if action.versions is not None:  # a sampler labels every action or none
            self.versions = (self.versions or []) + action.versions
        self.rewards.append((len(self.ids) - 1, outcome.reward))
        self.texts.append(action.text)
        # the records: each action with its reward, then what answered it (an empty answer left out)
        self.turns += [{"role": "assistant", "content": action.text, "reward": outcome.reward},
                       *(m for m in outcome.messages if m.get("content"))]
        self.num_turns += 1
        self.last_stopped = action.stopped
        self.tool_calls += outcome.tool_calls
        self.tool_errors += outcome.tool_errors
        self.tool_timeouts += outcome.tool_timeouts
        for name, value in outcome.extra_logs.items():
            self.logs.setdefault(name, []).append(float(value))
        self.overrides = dict(outcome.sampling_params or {})
        if outcome.done:
            self.end = outcome.end_reason
        elif last_turn:
            self.end = "max_turns"
        else:
            room = budget - len(self.ids)
            if len(outcome.observation_ids) >= room:  # no token left for another action after it
                self.end = "max_response_tokens"
            observation = list(outcome.observation_ids[:room])
            self.ids += observation
            self.mask += [0] * len(observation)
            self.logprobs += [0.0] * len(observation)
            if self.versions is not None:
                self.versions += [0] * len(observation)
            self.texts.append(decode(observation))
            self.observation_tokens += len(observation)

    def record(self) -> dict[str, Any]:
        """The row's entry of `Batch.episodes`; extra_logs: each name's mean over the turns that logged it."""
        return {"turns": self.turns, "num_turns": self.num_turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "tool_timeouts": self.tool_timeouts,
                "observation_tokens": self.observation_tokens, "end": self.end,
                "extra_logs": {name: mean(values) for name, values in self.logs.items()}}


def turn_rewards(episodes: Sequence[Episode], width: int) -> torch.Tensor:
    """[B, width] float32: each turn's reward on the column of its action's last token, 0 elsewhere."""
    rewards = torch.zeros(len(episodes), width, dtype=torch.float32)
    for row, episode in enumerate(episodes):
        for column, reward in episode.rewards:
            rewards[row, column] += reward
    return rewards


def rollout_batch(prompts: Batch, n: int, episodes: Sequence[Episode], pad_id: int) -> Batch:
    """The rollout Batch of finished episodes (row i*n+j: episode j of prompt i), with
    `turn_rewards` and `episodes`; `response_text` the whole block's text, observations included; and
    `token_version` where the sampler labelled the actions (partial rollouts)."""
    labelled = any(e.versions is not None for e in episodes)
    batch = assemble_rollout(prompts, n, [e.ids for e in episodes], [e.logprobs for e in episodes],
                             [e.truncated for e in episodes], ["".join(e.texts) for e in episodes], pad_id,
                             response_masks=[e.mask for e in episodes],
                             prompt_ids=[e.prompt_ids if e.new_prompt else None for e in episodes],
                             versions=[e.versions or [] for e in episodes] if labelled else None)
    return batch.with_fields(turn_rewards=turn_rewards(episodes, batch.response_length),
                             episodes=[e.record() for e in episodes])


class MultiTurnSampler:
    """The `Sampler` of multi-turn rollouts around `inner`, which generates every action (weight
    sync, sleep and wake are its). `new_episodes()` builds the environments of one batch
    (`agents.Episodes`); `tokenizer` is the policy's (the inner sampler's)."""

    def __init__(self, inner: ContinuingSampler, cfg: SamplerConfig, tokenizer: Any,
                 new_episodes: Callable[[], "Episodes"]) -> None:
        self.inner = inner
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.new_episodes = new_episodes
        self.pad_id = inner.pad_id
        # the ids that close an assistant turn; a turn cut short gets its closing token with the tool turn
        self.eos_ids = set(inner.eos_ids)

    def generate(self, batch: Batch, n: int, seed: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None) -> Batch:
        """`n` episodes per prompt (row i*n+j: episode j of prompt i), deterministic given `seed`:
        each row draws a seed per turn from it, whichever rows are still running."""
        prompts = [p for p in prompt_token_lists(batch) for _ in range(n)]
        per_turn = max_new_tokens or self.cfg.max_new_tokens
        budget = response_budget(self.cfg, max_new_tokens)
        max_turns = self.cfg.multi_turn.max_turns
        rng = random.Random(seed)
        envs = self.new_episodes()
        try:
            episodes = self._reset(envs, batch, prompts, n)
            for turn in range(max_turns):
                seeds = [rng.getrandbits(31) for _ in episodes]
                running = [r for r, e in enumerate(episodes) if e.end is None]
                if not running:
                    break
                contexts = [episodes[r].context for r in running]
                actions = self.inner.complete(contexts, [seeds[r] for r in running],
                                              [episodes[r].sampling(per_turn, budget, temperature) for r in running],
                                              greedy)
                # the environment sees the text before the action, chat markup included (OpenRLHF's observation)
                outcomes = envs.step(running, [a.text for a in actions],
                                     [self.tokenizer.decode(c, skip_special_tokens=False) for c in contexts],
                                     closed=[bool(a.token_ids) and a.token_ids[-1] in self.eos_ids for a in actions])
                for r, action, outcome in zip(running, actions, outcomes):
                    episodes[r].add_turn(action, outcome, turn + 1 == max_turns, budget, self._decode)
        finally:
            envs.close()
        return rollout_batch(batch, n, episodes, self.pad_id)

    def _reset(self, envs: "Episodes", batch: Batch, prompts: list[list[int]], n: int) -> list[Episode]:
        """Reset every row's environment; a reset that returns text replaces the row's prompt with it."""
        def repeated(values: Optional[list[Any]]) -> list[Any]:
            return [None] * len(prompts) if values is None else [v for v in values for _ in range(n)]

        outcomes = envs.reset([self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts],
                              repeated(batch.ground_truth), repeated(batch.data_source), repeated(batch.extra_info))
        episodes = []
        for row, (prompt, outcome) in enumerate(zip(prompts, outcomes)):
            if outcome.observation is not None:
                prompt = self.tokenizer(outcome.observation, add_special_tokens=False)["input_ids"]
                if not prompt:
                    raise ValueError(f"sampler.multi_turn.env: reset returned an empty prompt for row {row}; "
                                     "return None to keep the data's prompt")
            failed = outcome.error is not None  # building or resetting the environment: one error or one timeout
            episodes.append(Episode(list(prompt), outcome.observation is not None,
                                    tool_errors=int(failed and not outcome.timeout), tool_timeouts=int(outcome.timeout)))
        return episodes

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def load_weight_bucket(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.inner.load_weight_bucket(state_dict)

    def set_policy_version(self, version: int) -> None:
        """`PartialSampler.set_policy_version` of `inner` (partial rollouts only: vLLM's partial sampler)."""
        self.inner.set_policy_version(version)

    def finish_weight_sync(self) -> None:
        self.inner.finish_weight_sync()

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()


def episodes_factory(cfg: SamplerConfig, tokenizer: Any,
                     chat_template_kwargs: Optional[dict] = None) -> Callable[[], "Episodes"]:
    """A builder of one batch's `agents.Episodes`, the environment class and tools loaded once, now
    (a bad reference fails at start, naming its key). The environment's `sampling_params` start as
    the sampler's; tool turns render with `chat_template_kwargs` (data.chat_template_kwargs), as the
    prompts did."""
    from ppo_trainer.agents import Episodes, load_multi_turn

    env_cls, tools = load_multi_turn(cfg.multi_turn, tokenizer, chat_template_kwargs)
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "max_tokens": cfg.max_new_tokens}
    return lambda: Episodes(cfg.multi_turn, tokenizer, env_cls, tools, sampling_params=sampling,
                            chat_template_kwargs=chat_template_kwargs)


def multi_turn_metrics(batch: Batch) -> dict[str, float]:
    """The rollout's episode statistics from `batch.episodes`: turns per episode, tool calls (mean),
    tool errors and timeouts (sums), the share of episodes per end reason, observation tokens per
    episode, and each environment log's mean over the episodes that logged it."""
    episodes = batch.episodes
    turns = [e["num_turns"] for e in episodes]
    metrics = {"num_turns/mean": mean(turns), "num_turns/max": float(max(turns)), "num_turns/min": float(min(turns)),
               "multi_turn/tool_calls/mean": mean(e["tool_calls"] for e in episodes),
               "multi_turn/tool_errors": float(sum(e["tool_errors"] for e in episodes)),
               "multi_turn/tool_timeouts": float(sum(e["tool_timeouts"] for e in episodes)),
               "multi_turn/observation_tokens/mean": mean(e["observation_tokens"] for e in episodes)}
    for reason in END_REASONS:
        metrics[f"multi_turn/end/{reason}"] = sum(e["end"] == reason for e in episodes) / len(episodes)
    for name in sorted({name for e in episodes for name in e["extra_logs"]}):
        metrics[f"multi_turn/env/{name}"] = mean(e["extra_logs"][name] for e in episodes if name in e["extra_logs"])
    return {k: float(v) for k, v in metrics.items()}
