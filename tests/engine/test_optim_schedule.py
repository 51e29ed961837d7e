"""Learning-rate schedule: linear warm-up, constant or cosine to the floor."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_trainer.config.schema import OptimConfig
from ppo_trainer.engine.optim import build_optimizer, build_scheduler, lr_factor


def test_warmup_is_linear_and_reaches_full_rate():
    assert [lr_factor(s, 4, "constant", None, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_full_rate_to_the_floor_and_stays():
    factors = [lr_factor(s, 2, "cosine", 12, 0.1) for s in range(14)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0
    assert factors[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[12] == pytest.approx(0.1) and factors[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))


def test_cosine_without_total_steps_is_an_error():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    with pytest.raises(ValueError, match="total"):
        build_scheduler(opt, OptimConfig(schedule="cosine"), None)


def test_weight_decay_skips_one_dimensional_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
