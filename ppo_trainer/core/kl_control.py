"""Controllers for the coefficient of the KL penalty in the reward (``token_rewards``' kl_coef)."""

from __future__ import annotations

import math
from typing import Any


class FixedKL:
    """A constant KL coefficient; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> bool:
        """Adjust the coefficient after a step that observed mean KL ``current_kl`` over ``n_steps``
        samples; False when a controller ignored a non-finite ``current_kl`` (nothing changed)."""
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKL(FixedKL):
    """Steer the KL coefficient so the observed KL tracks ``target`` (Ziegler et al., 2019):
    ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
        super().__init__(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> bool:
        if not math.isfinite(current_kl):  # one NaN would make the coefficient NaN for good
            return False
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
        return True
