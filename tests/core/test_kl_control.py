"""FixedKL and AdaptiveKL: the Ziegler et al. update rule and exact state round trips."""

import pytest

from ppo_trainer.core.kl_control import AdaptiveKL, FixedKL


def test_adaptive_kl_follows_the_proportional_rule_over_several_steps():
    controller = AdaptiveKL(init_coef=0.2, target=6.0, horizon=10000)
    expected = 0.2
    # (observed kl, n_steps, multiplier = 1 + clip(kl / 6 - 1, -0.2, 0.2) * n_steps / 10000)
    for kl, n_steps, multiplier in [
        (3.0, 256, 1 - 0.2 * 256 / 10000),  # error -0.5 clipped to -0.2
        (6.6, 256, 1 + 0.1 * 256 / 10000),  # error 0.1, inside the clip
        (100.0, 512, 1 + 0.2 * 512 / 10000),  # error 15.67 clipped to 0.2
        (6.0, 1000, 1.0),  # on target: unchanged
    ]:
        controller.update(kl, n_steps)
        expected *= multiplier
        assert controller.value == pytest.approx(expected, rel=1e-12)
    assert controller.value == pytest.approx(0.2 * 0.99488 * 1.00256 * 1.01024, rel=1e-12)


def test_adaptive_kl_state_dict_round_trip_resumes_exactly():
    controller = AdaptiveKL(0.05, target=1.0, horizon=500)
    for kl in (0.3, 2.5, 1.1):
        controller.update(kl, 64)
    restored = AdaptiveKL(0.05, target=1.0, horizon=500)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    controller.update(0.7, 64)
    restored.update(0.7, 64)
    assert restored.value == controller.value


def test_adaptive_kl_rejects_non_positive_target_or_horizon():
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKL(0.1, target=0.0, horizon=100)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKL(0.1, target=1.0, horizon=0)


def test_fixed_kl_never_changes_and_round_trips():
    controller = FixedKL(0.001)
    controller.update(50.0, 1024)
    assert controller.value == 0.001
    restored = FixedKL(0.5)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.001
