"""Property: what masked positions hold never changes any output (values, losses, gradients)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer.core.choices import AGG_MODES
from ppo_trainer.core.gae import compute_gae, token_rewards
from ppo_trainer.core.losses import aggregate, policy_loss, value_loss
from ppo_trainer.core.masked import masked_center, masked_whiten
from ppo_trainer.core.metrics import explained_variance

PROPERTY = settings(max_examples=30, deadline=None)


@st.composite
def masked_batches(draw):
    """A random mask, random data, and a copy of the data with garbage on masked positions."""
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 7))
    bits = draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
    mask = torch.tensor(bits).reshape(batch, length)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    names = ("a", "b", "c", "d")
    clean = {name: torch.randn(batch, length, generator=gen, dtype=torch.float64) for name in names}
    garbage = draw(st.sampled_from([1e4, -1e4, float("inf"), float("nan")]))
    dirty = {
        name: torch.where(mask, x, torch.randn(batch, length, generator=gen, dtype=torch.float64) * garbage)
        for name, x in clean.items()
    }
    return mask, clean, dirty


def assert_same(left, right):
    for x, y in zip(left, right, strict=True):
        assert torch.equal(x, y), (x, y)


@PROPERTY
@given(masked_batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_masked_positions_never_affect_gae(data, gamma, lam):
    mask, clean, dirty = data
    advantages, returns = compute_gae(clean["a"], clean["b"], mask, gamma, lam)
    assert_same((advantages, returns), compute_gae(dirty["a"], dirty["b"], mask, gamma, lam))
    assert not advantages[~mask].any() and not returns[~mask].any()


@PROPERTY
@given(masked_batches(), st.sampled_from(["k1", "abs", "k2", "k3"]))
def test_masked_positions_never_affect_token_rewards(data, kind):
    mask, clean, dirty = data
    scores = torch.arange(mask.shape[0], dtype=torch.float64)
    rewards = token_rewards(scores, clean["a"], clean["b"], mask, 0.1, kind)
    assert_same(rewards, token_rewards(scores, dirty["a"], dirty["b"], mask, 0.1, kind))


@PROPERTY
@given(masked_batches())
def test_masked_positions_never_affect_whitening_centring_or_explained_variance(data):
    mask, clean, dirty = data
    for normalize in (masked_whiten, masked_center):
        normalized = normalize(clean["a"], mask)
        assert torch.equal(normalized, normalize(dirty["a"], mask))
        assert not normalized[~mask].any()
    assert torch.equal(explained_variance(clean["a"], clean["b"], mask), explained_variance(dirty["a"], dirty["b"], mask))


@PROPERTY
@given(masked_batches(), st.sampled_from(AGG_MODES))
def test_masked_positions_never_affect_aggregate(data, mode):
    mask, clean, dirty = data
    assert torch.equal(aggregate(clean["a"], mask, mode), aggregate(dirty["a"], mask, mode))


def loss_and_grads(loss_fn, tensors, mask, **options):
    leaves = [t.clone().requires_grad_(True) for t in tensors[:2]]
    outputs = loss_fn(*leaves, *tensors[2:], mask, **options)
    grads = torch.autograd.grad(outputs.loss, leaves, allow_unused=True)
    return [*outputs, *(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))]


@PROPERTY
@given(masked_batches(), st.sampled_from(AGG_MODES), st.sampled_from([None, 2.0]))
def test_masked_positions_never_affect_policy_loss_or_its_gradient(data, mode, dual_clip):
    mask, clean, dirty = data
    options = dict(clip_low=0.2, clip_high=0.3, dual_clip=dual_clip, agg=mode)
    reference = loss_and_grads(policy_loss, [clean["a"], clean["b"], clean["c"]], mask, **options)
    garbage = loss_and_grads(policy_loss, [dirty["a"], dirty["b"], dirty["c"]], mask, **options)
    assert_same(reference, garbage)


@PROPERTY
@given(masked_batches(), st.sampled_from(AGG_MODES), st.sampled_from([None, 0.2]))
def test_masked_positions_never_affect_value_loss_or_its_gradient(data, mode, clip):
    mask, clean, dirty = data
    options = dict(clip=clip, agg=mode)
    reference = loss_and_grads(value_loss, [clean["a"], clean["b"], clean["c"]], mask, **options)
    garbage = loss_and_grads(value_loss, [dirty["a"], dirty["b"], dirty["c"]], mask, **options)
    assert_same(reference, garbage)
