"""Environments of the built-in tasks, written as a user writes one (OpenRLHF's shape): the proof
that multi-turn PPO learns what one turn cannot (docs/multi-turn.md, docs/learning.md)."""

from __future__ import annotations

from typing import Any

from ppo_trainer.agents.environment import AgentInstanceBase


class RevealDigit(AgentInstanceBase):
    """The digits task `reveal` (data.digits.task=reveal): the label is a digit the prompt does not
    show. A first answer whose first character is the digit earns 1 and ends the episode; a miss is
    answered with the digit (" no:7=", appended verbatim after the answer) and the second answer
    earns 1 if it says it. Reward per turn, on the turn's last token; two turns at most."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turns = 0

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turns += 1
        label = str(states["label"])
        correct = states["action_text"].strip()[:1] == label
        done = correct or self.turns >= 2
        return {"rewards": float(correct), "done": done, "environment_feedback": "" if done else f" no:{label}=",
                "extra_logs": {"solved_at_first_turn": float(correct and self.turns == 1)}}
