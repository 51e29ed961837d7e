"""The critic warm-up (VAPO's value pre-training): the first PPO steps update only the critic, on
Monte Carlo returns of the initial policy's rollouts, so that the actor's first advantages come
from a critic that has seen its returns. It lasts ``algorithm.critic_warmup`` steps at most and, with
``algorithm.critic_warmup_explained_var``, ends as soon as the critic explains that much of them."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional


def warmup_ends(step: int, cap: int, explained_var: float, target: Optional[float]) -> bool:
    """Whether warm-up step ``step`` is the last one: the cap is reached, or the step's
    critic/vf_explained_var (the values from before this step's critic update, against this step's
    fresh returns: an out-of-sample measure) reached ``target``. NaN never reaches it."""
    return step >= cap or (target is not None and math.isfinite(explained_var) and explained_var >= target)


def deciding_explained_var(metrics: Mapping[str, float]) -> Optional[float]:
    """The explained variance a warm-up step is judged on: its critic/vf_explained_var, out of sample,
    except on the step whose value head was just fitted to that step's own returns
    (critic.value_head_init=regression), where the values are in sample and the fit's
    cross-validated critic/value_head_fit/cv_explained_var says how far they generalise.
    None without a critic."""
    return metrics.get("critic/value_head_fit/cv_explained_var", metrics.get("critic/vf_explained_var"))


class CriticWarmup:
    """Where a run stands in the warm-up: ``last_step`` is None while it lasts, then the step that
    ended it (0 without a warm-up). The decision is taken at the end of a step (``observe``), from
    that step's numbers only, and is part of the trainer's saved state: a resumed run ends its
    warm-up where the uninterrupted run did."""

    def __init__(self, cap: int, target: Optional[float]) -> None:
        self.cap, self.target = cap, target
        self.last_step: Optional[int] = 0 if cap == 0 else None

    def active(self, step: int) -> bool:
        """Whether ``step`` only updates the critic, on Monte Carlo returns."""
        return self.last_step is None and step <= self.cap

    def metric_phase(self, step: int) -> Optional[str]:
        """"before" at step 1 and "after" at the first step past the warm-up (the suffixes of
        critic/warmup_vf_explained_var_before/_after), else None; None throughout without a warm-up."""
        if not self.cap:
            return None
        if step == 1:
            return "before"
        end = self.cap if self.last_step is None else self.last_step
        return "after" if step == end + 1 else None

    def observe(self, step: int, explained_var: float) -> None:
        """After step ``step``: end the warm-up there when it was a warm-up step and `warmup_ends`."""
        if self.active(step) and warmup_ends(step, self.cap, explained_var, self.target):
            self.last_step = step

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = state["last_step"]
