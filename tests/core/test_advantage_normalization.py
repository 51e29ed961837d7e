"""Advantage normalization: whitening, and centring alone (gae.advantage_std_scale=false, OpenRLHF's
no_std_norm), against hand-computed numbers and a slow float64 reference."""

import torch

from ppo_trainer.config.schema import GaeConfig
from ppo_trainer.core.advantages import normalize
from ppo_trainer.core.masked import WHITEN_EPS, masked_center, masked_whiten


def reference_normalize(x, mask, scale):
    """Element by element in Python floats: mean (and Bessel-corrected variance) over valid tokens."""
    valid = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)
    factor = (var + WHITEN_EPS) ** -0.5 if scale else 1.0
    rows = [[(v - mean) * factor if m else 0.0 for v, m in zip(xr, mr)] for xr, mr in zip(x.tolist(), mask.tolist())]
    return torch.tensor(rows, dtype=torch.float64)


def test_centring_subtracts_the_mean_of_valid_tokens_only_and_keeps_the_spread():
    x = torch.tensor([[2.0, 4.0, 6.0, 1e6], [10.0, float("nan"), -3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # valid 2, 4, 6, 10: mean 5.5; masked 1e6, nan, -3 and 7 count for nothing
    assert masked_center(x, mask).tolist() == [[-3.5, -1.5, 0.5, 0.0], [4.5, 0.0, 0.0, 0.0]]


def test_normalize_without_std_scale_centres_and_does_not_divide():
    x = torch.tensor([[2.0, 4.0, 6.0, 1e6], [10.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    centred = normalize(x, mask, GaeConfig(advantage_std_scale=False))
    assert centred.tolist() == [[-3.5, -1.5, 0.5, 0.0], [4.5, 0.0, 0.0, 0.0]]
    # whitening divides the same centred values by sqrt(var) = sqrt(35 / 3)
    whitened = normalize(x, mask, GaeConfig())
    torch.testing.assert_close(whitened, centred / (35.0 / 3.0 + WHITEN_EPS) ** 0.5)


def test_normalize_leaves_advantages_as_gae_gave_them_when_normalization_is_off():
    x = torch.tensor([[2.0, 4.0, 6.0, 0.0]])
    assert torch.equal(normalize(x, torch.tensor([[1, 1, 1, 0]]), GaeConfig(normalize_advantages=False)), x)


def test_centring_and_whitening_match_a_slow_float64_reference():
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 41, generator=gen, dtype=torch.float64) * 3 + 2
        mask = (torch.rand(16, 41, generator=gen) < 0.6).long()
        x = torch.where(mask.bool(), x, torch.tensor(float("inf"), dtype=torch.float64))
        for scale, fn in ((False, masked_center), (True, masked_whiten)):
            assert (fn(x, mask) - reference_normalize(x, mask, scale)).abs().max() < 1e-12
