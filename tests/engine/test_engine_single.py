"""ActorEngine and CriticEngine in one process (a 1-rank FSDP2 group on CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    BIG_BUDGET,
    PROMPT_LENS,
    RESPONSE_LENS,
    SMALL_BUDGET,
    algorithm,
    full_grads,
    make_actor,
    make_critic,
    model_config,
    naive_logprobs,
    random_batch,
)

from ppo_trainer.config.schema import CriticConfig, LoraConfig, OptimConfig
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine


@pytest.fixture(scope="module", params=[1, 2], ids=["own-prompts", "2-samples-per-prompt"])
def batch(request):
    """8 rows with their own prompts, or 4 prompts of 2 samples (their forwards pack the prompt once)."""
    return random_batch(PROMPT_LENS, RESPONSE_LENS, samples=request.param)


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [SMALL_BUDGET, BIG_BUDGET])
def test_compute_logprobs_equal_plain_transformers_for_any_budget(tiny_model_dir, plain_model, batch, budget):
    actor = make_actor(tiny_model_dir, budget=budget)
    expected = naive_logprobs(plain_model, batch, temperature=0.7)
    torch.testing.assert_close(actor.compute_logprobs(batch), expected, atol=1e-5, rtol=0)
    logp, entropy = actor.compute_logprobs_and_entropy(batch)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    assert torch.all((entropy > 0) == batch.response_mask.bool())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradients_accumulated_over_micro_batches_equal_one_big_batch(tiny_model_dir, batch, agg):
    actor = make_actor(tiny_model_dir, algorithm={"loss_agg_mode": agg, "entropy_coef": 0.01, "use_kl_loss": True})
    grads, stats = {}, {}
    for budget in (BIG_BUDGET, SMALL_BUDGET):
        stats[budget] = actor.backward_mini_batch(batch, actor.micro_batch_loss, budget)
        grads[budget] = full_grads(actor.module)
        actor.optimizer.zero_grad(set_to_none=True)
    assert grads[BIG_BUDGET].keys() == grads[SMALL_BUDGET].keys()
    for name, g in grads[BIG_BUDGET].items():
        torch.testing.assert_close(grads[SMALL_BUDGET][name], g, atol=1e-6, rtol=1e-5)
    assert stats[BIG_BUDGET].keys() == {"pg_loss", "pg_clipfrac", "ppo_kl", "update_entropy", "kl_loss",
                                        "padding_share"}
    for key, value in stats[BIG_BUDGET].items():
        if key != "padding_share":  # the micro-batches' own padding
            assert stats[SMALL_BUDGET][key] == pytest.approx(value, abs=1e-6)


def test_update_reports_metrics_and_warms_up_the_learning_rate(tiny_model_dir, batch):
    actor = ActorEngine(
        model_config(tiny_model_dir, optim=OptimConfig(lr=1e-3, warmup_steps=4)),
        tiny_model_dir,
        algorithm(entropy_coef=0.01, use_kl_loss=True, ppo_epochs=2, shuffle_mini_batches=True),
        mini_batch_size=4,
        temperature=0.7,
    )
    batch = batch.with_fields(old_logprobs=actor.compute_logprobs(batch))
    metrics = actor.update(batch)  # 2 epochs x 2 mini-batches: lr factors 1/4, 2/4, 3/4, 4/4
    assert set(metrics) == {f"actor/{k}" for k in
                            ("pg_loss", "pg_clipfrac", "ppo_kl", "update_entropy", "kl_loss", "grad_norm", "lr", "skipped_steps",
                             "padding_share")}
    assert 0 <= metrics["actor/padding_share"] < 1
    assert metrics["actor/lr"] == pytest.approx(1e-3 * (0.25 + 0.5 + 0.75 + 1.0) / 4)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/update_entropy"] > 0
    assert (actor.compute_logprobs(batch) - batch.old_logprobs).abs().max() > 1e-3


def test_reference_copy_keeps_the_initial_policy(tiny_model_dir, batch):
    actor = ActorEngine(model_config(tiny_model_dir), tiny_model_dir, algorithm(), mini_batch_size=8,
                        temperature=0.7, use_reference=True)
    initial = actor.compute_logprobs(batch)
    assert torch.equal(actor.compute_ref_logprobs(batch), initial)
    actor.update(batch.with_fields(old_logprobs=initial))
    assert (actor.compute_logprobs(batch) - initial).abs().max() > 1e-4
    assert torch.equal(actor.compute_ref_logprobs(batch), initial)


def test_lora_actor_reference_export_and_merged_weights(tiny_model_dir, plain_model, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = model_config(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8), optim=OptimConfig(lr=1e-2))
    actor = ActorEngine(cfg, tiny_model_dir, algorithm(), mini_batch_size=8, temperature=0.7, use_reference=True)
    assert actor.reference is None  # the reference is the same module with the adapter disabled
    base = naive_logprobs(plain_model, batch, temperature=0.7)
    initial = actor.compute_logprobs(batch)
    torch.testing.assert_close(initial, base, atol=1e-5, rtol=0)  # zero-initialised B
    actor.update(batch.with_fields(old_logprobs=initial))
    trained = actor.compute_logprobs(batch)
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(actor.compute_ref_logprobs(batch), base, atol=1e-5, rtol=0)

    merged = actor.full_state_dict()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(merged)  # strict: base names only
    torch.testing.assert_close(naive_logprobs(plain, batch, 0.7), trained, atol=1e-5, rtol=0)

    actor.save_hf(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    torch.testing.assert_close(naive_logprobs(reloaded, batch, 0.7), trained, atol=1e-5, rtol=0)


@pytest.mark.parametrize("switch", ["cpu_offload", "gradient_checkpointing"])
def test_memory_switches_give_the_same_update(tiny_model_dir, batch, switch):
    results = []
    for on in (False, True):
        actor = make_actor(tiny_model_dir, **{switch: on})
        actor.update(batch)
        results.append(actor.full_state_dict())
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, atol=1e-7, rtol=0)


def test_bfloat16_compute_trains_with_float32_master_weights(tiny_model_dir, batch):
    actor = ActorEngine(model_config(tiny_model_dir, dtype="bfloat16"), tiny_model_dir, algorithm(),
                        mini_batch_size=8, temperature=0.7, use_reference=True)
    critic = CriticEngine(CriticConfig(dtype="bfloat16"), tiny_model_dir, algorithm(), mini_batch_size=8)
    logprobs = actor.compute_logprobs(batch)
    assert logprobs.dtype == torch.float32
    assert torch.equal(actor.compute_ref_logprobs(batch), logprobs)  # bf16-stored reference, same rounding
    torch.testing.assert_close(logprobs, make_actor(tiny_model_dir).compute_logprobs(batch), atol=0.05, rtol=0)
    metrics = {**actor.update(batch.with_fields(old_logprobs=logprobs)), **critic.update(batch)}
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert all(p.dtype == torch.float32 for p in actor.module.parameters())
    assert all(v.dtype == torch.float32 for v in critic.full_state_dict().values())


def test_the_critics_optimizer_takes_its_betas_eps_and_decays_to_its_cosine_floor(tiny_model_dir):
    cfg = CriticConfig(dtype="float32", optim=OptimConfig(lr=1e-3, betas=[0.8, 0.95], eps=1e-6, schedule="cosine",
                                                          min_lr_ratio=0.1))
    critic = CriticEngine(cfg, tiny_model_dir, algorithm(), mini_batch_size=8, total_steps=10)
    groups = critic.optimizer.param_groups
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in groups)
    for _ in range(10):
        critic.optimizer.step()  # no gradients: moves nothing, keeps the scheduler's order of calls
        critic.scheduler.step()
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * 0.1] * len(groups))


def test_critic_learns_the_returns_and_its_export_reloads_exactly(tiny_model_dir, batch, tmp_path):
    from ppo_trainer.models.critic import ValueModel

    critic = CriticEngine(CriticConfig(dtype="float32", optim=OptimConfig(lr=3e-3), value_clip=None), tiny_model_dir,
                          algorithm(), mini_batch_size=8)
    values = critic.compute_values(batch)
    assert values.shape == batch.response_mask.shape and torch.all(values == 0)  # zero head
    batch = batch.with_fields(values=values)
    losses = [critic.update(batch)["critic/vf_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    assert set(critic.update(batch)) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr",
                                         "critic/skipped_steps", "critic/padding_share"}

    critic.save_hf(tmp_path / "critic")
    reloaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    with torch.no_grad():
        got = reloaded(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask)
    torch.testing.assert_close(got * batch.response_mask, critic.compute_values(batch), atol=1e-6, rtol=0)


@pytest.mark.parametrize("role", ["actor", "lora-actor", "critic", "lora-critic"])
def test_save_reload_and_continue_equals_not_stopping(tiny_model_dir, batch, tmp_path, role):
    make = {"actor": make_actor, "critic": make_critic,
            "lora-actor": lambda d, **k: make_actor(d, lora=LoraConfig(rank=4, alpha=8), **k),
            "lora-critic": lambda d, **k: make_critic(d, lora=LoraConfig(rank=4, alpha=8), **k)}[role]
    second = random_batch(PROMPT_LENS, RESPONSE_LENS, seed=1)
    engine = make(tiny_model_dir, mini_batch_size=4)
    engine.update(batch)
    engine.save_state(tmp_path / "state")
    expected_metrics = engine.update(second)
    expected = engine.full_state_dict()

    resumed = make(tiny_model_dir, mini_batch_size=4)
    resumed.load_state(tmp_path / "state")
    assert resumed.update(second) == expected_metrics
    for key, value in resumed.full_state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_lora_actor_whose_first_forward_is_the_reference_trains_in_bfloat16_on_a_bfloat16_base(tiny_model_dir, batch):
    # FSDP2 settles its gradient dtypes at the first forward; peft's disable_adapter() froze the
    # adapter during it, so the bf16 LoRA gradients were assigned to float32 weights (an error)
    cfg = model_config(tiny_model_dir, dtype="bfloat16", lora=LoraConfig(rank=4, alpha=8), optim=OptimConfig(lr=1e-2))
    actor = ActorEngine(cfg, tiny_model_dir, algorithm(), mini_batch_size=8, temperature=0.7, use_reference=True)
    reference = actor.compute_ref_logprobs(batch)
    actor.backward_mini_batch(batch.with_fields(old_logprobs=reference), actor.micro_batch_loss, SMALL_BUDGET)
    grads = full_grads(actor.module)
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().max() > 0 for g in grads.values())
    # the frozen base is stored in the compute dtype (half the memory), the adapter in float32
    assert {(p.dtype, p.requires_grad) for p in actor.module.parameters()} == {(torch.bfloat16, False),
                                                                             (torch.float32, True)}


def test_shuffled_mini_batches_hold_whole_prompt_groups(tiny_model_dir, monkeypatch):
    batch = random_batch(PROMPT_LENS * 2, RESPONSE_LENS * 2, samples=4)  # 4 prompts of 4 samples
    actor = make_actor(tiny_model_dir, algorithm={"shuffle_mini_batches": True})
    seen: list[list[int]] = []

    def record(mini_batch, loss_fn, budget):
        seen.append(sorted(map(tuple, mini_batch.input_ids[:, : mini_batch.prompt_length].tolist())))
        return {}

    monkeypatch.setattr(actor, "backward_mini_batch", record)
    monkeypatch.setattr(actor, "optimizer_step", lambda: {"grad_norm": 0.0, "lr": 0.0, "skipped_steps": 0.0})
    for _ in range(3):
        actor.train(batch, actor.micro_batch_loss, mini_batch_size=8, algorithm=actor.algorithm, seed=0, epochs=1)
    orders = [[prompts[0], prompts[4]] for prompts in seen[::2]]  # the two prompts of each first mini-batch
    assert all(len(set(prompts)) == 2 and prompts.count(prompts[0]) == 4 for prompts in seen)
    assert len({tuple(o) for o in orders}) > 1  # the prompts are shuffled between updates


@pytest.mark.parametrize("critic_epochs, steps", [(None, 2 * 2), (3, 2 * 3)])
def test_the_critic_takes_its_own_epochs_of_optimizer_steps(tiny_model_dir, batch, critic_epochs, steps):
    """critic.ppo_epochs passes of 2 mini-batches each (algorithm.ppo_epochs=2 when it is null)."""
    critic = CriticEngine(CriticConfig(dtype="float32", optim=OptimConfig(lr=1e-4), ppo_epochs=critic_epochs),
                          tiny_model_dir, algorithm(ppo_epochs=2), mini_batch_size=4)
    critic.update(batch.with_fields(values=critic.compute_values(batch)))
    assert critic.scheduler.last_epoch == steps


def test_a_value_head_fitted_to_the_first_returns_explains_them_where_the_zero_head_explains_none(tiny_model_dir):
    """A toy first step: 8 prompts of 4 samples, each prompt's return 0 or 1 on every token. The
    fitted head explains those returns, and those of new responses to the same prompts."""
    from ppo_trainer.core.metrics import explained_variance

    lens = (PROMPT_LENS * 4, RESPONSE_LENS * 4)
    first, later = random_batch(*lens, seed=0, samples=4), random_batch(*lens, seed=1, samples=4)
    P = first.prompt_length
    later = later.with_fields(input_ids=torch.cat([first.input_ids[:, :P], later.input_ids[:, P:]], dim=1))
    outcome = torch.rand(8, generator=torch.Generator().manual_seed(3)).round().repeat_interleave(4)[:, None]
    critic = make_critic(tiny_model_dir)
    zero = explained_variance(critic.compute_values(first), outcome * first.response_mask, first.response_mask)
    metrics = critic.fit_value_head(first.with_fields(returns=outcome * first.response_mask))
    fitted = [explained_variance(critic.compute_values(b), outcome * b.response_mask, b.response_mask).item()
              for b in (first, later)]
    assert zero.item() == 0.0
    assert fitted[0] > 0.9 and fitted[1] > 0.5
    assert set(metrics) == {"critic/value_head_fit/ridge", "critic/value_head_fit/cv_explained_var"}
