"""The critic warm-up's stopping rule (`core.critic_warmup`): the cap, the explained-variance target,
the metrics' phases and the state a resume continues from."""

import math

import pytest

from ppo_trainer.core.critic_warmup import CriticWarmup, deciding_explained_var, warmup_ends


@pytest.mark.parametrize("step, explained_var, target, ends", [
    (3, 0.2, 0.5, False),  # below the target, before the cap
    (3, 0.5, 0.5, True),  # reaching the target ends it
    (3, 0.9, 0.5, True),
    (10, -1.0, 0.5, True),  # the cap ends it whatever the critic explains
    (3, 0.99, None, False),  # without a target only the cap ends it
    (10, 0.0, None, True),
    (3, math.nan, 0.5, False),  # a NaN never reaches the target
])
def test_the_warmup_ends_at_the_cap_or_once_the_explained_variance_reaches_the_target(step, explained_var, target,
                                                                                      ends):
    assert warmup_ends(step, cap=10, explained_var=explained_var, target=target) is ends


def run(warmup: CriticWarmup, explained_vars: list[float], first_step: int = 1) -> list[tuple[int, bool, str | None]]:
    """(step, active, metric phase) of each step from `first_step` on, observing its explained variance after it."""
    seen = []
    for step, ev in enumerate(explained_vars, start=first_step):
        seen.append((step, warmup.active(step), warmup.metric_phase(step)))
        warmup.observe(step, ev)
    return seen


def test_the_step_whose_explained_variance_reaches_the_target_is_the_last_warmup_step():
    warmup = CriticWarmup(cap=5, target=0.5)
    assert run(warmup, [0.0, 0.3, 0.6, 0.2, 0.9]) == [
        (1, True, "before"), (2, True, None), (3, True, None), (4, False, "after"), (5, False, None)]
    assert warmup.last_step == 3  # a later fall below the target changes nothing


def test_without_a_target_the_warmup_lasts_its_cap():
    warmup = CriticWarmup(cap=2, target=None)
    assert run(warmup, [0.9, 0.9, 0.9, 0.9]) == [(1, True, "before"), (2, True, None), (3, False, "after"),
                                                (4, False, None)]
    assert warmup.last_step == 2


def test_a_target_never_reached_ends_the_warmup_at_its_cap():
    warmup = CriticWarmup(cap=2, target=0.5)
    assert [active for _, active, _ in run(warmup, [0.1, 0.2, 0.9])] == [True, True, False]
    assert warmup.last_step == 2


def test_no_warmup_has_no_warmup_steps_and_no_phases():
    warmup = CriticWarmup(cap=0, target=None)
    assert run(warmup, [0.0, 1.0]) == [(1, False, None), (2, False, None)]
    assert warmup.state_dict() == {"last_step": 0}


def test_a_warmup_restored_from_its_state_continues_as_the_uninterrupted_one():
    explained_vars = [0.1, 0.2, 0.7, 0.1]
    uninterrupted = run(CriticWarmup(cap=10, target=0.6), explained_vars)
    first = CriticWarmup(cap=10, target=0.6)
    run(first, explained_vars[:2])
    resumed = CriticWarmup(cap=10, target=0.6)
    resumed.load_state_dict(first.state_dict())
    assert run(resumed, explained_vars[2:], first_step=3) == uninterrupted[2:] == [(3, True, None), (4, False, "after")]


def test_the_step_that_fitted_the_value_head_is_judged_on_the_fits_held_out_figure():
    fitted = {"critic/vf_explained_var": 0.44, "critic/value_head_fit/cv_explained_var": 0.05}
    assert deciding_explained_var(fitted) == 0.05  # the in-sample 0.44 would end a 0.3 warm-up at once
    assert deciding_explained_var({"critic/vf_explained_var": 0.2}) == 0.2
    assert deciding_explained_var({}) is None
