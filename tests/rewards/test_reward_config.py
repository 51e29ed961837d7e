"""reward.* keys that cannot work together are config errors naming the key, before anything loads."""

from __future__ import annotations

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError

CASES = [
    (["reward.timeout_s=5"], "'reward.timeout_s' needs reward.num_workers >= 1: a call in the driver cannot be stopped"),
    (["reward.num_workers=1", "reward.timeout_s=0"], "'reward.timeout_s' must be > 0, or null for no bound, got 0"),
    (["reward.num_workers=-1"], "'reward.num_workers' must be >= 0, got -1"),
    (["reward.batched=true", "reward.num_workers=2"], "'reward.num_workers' is 2, but a batched function"),
    (["reward.truncation_penalty=-0.5"], "'reward.truncation_penalty' must be >= 0, got -0.5"),
    (["reward.overlong_buffer=16"], "'reward.overlong_buffer' (16) must be below sampler.max_new_tokens (16)"),
    (["reward.overlong_penalty=2.0"], "'reward.overlong_penalty' is set but reward.overlong_buffer=0 applies no "
                                      "overlong penalty"),
    (["reward.overlong_buffer=4", "reward.overlong_penalty=0"], "'reward.overlong_penalty' must be > 0, got 0"),
    (["reward.fn=my_rewards.score"], "'reward.fn' is 'my_rewards.score'; expected 'module:function' or "
                                     "'path/to/file.py:function'"),
]


@pytest.mark.parametrize(("overrides", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_reward_keys_that_cannot_work_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(["+experiment=smoke", *overrides])
    assert message in str(err.value)


def test_the_pool_timeouts_and_shaping_compose():
    r = compose(["+experiment=smoke", "reward.num_workers=4", "reward.timeout_s=2.5", "reward.truncation_penalty=0.5",
                 "reward.overlong_buffer=4", "reward.overlong_penalty=0.5"]).reward
    assert (r.num_workers, r.timeout_s, r.truncation_penalty, r.overlong_buffer, r.overlong_penalty) == (4, 2.5, 0.5, 4,
                                                                                                          0.5)
    assert compose(["+experiment=smoke", "reward.batched=true", "reward.num_workers=1"]).reward.batched
