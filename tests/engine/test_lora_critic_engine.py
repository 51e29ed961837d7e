"""CriticEngine with LoRA (critic.lora.rank > 0) in one process (a 1-rank FSDP2 group on CPU): it trains
its adapters and its value head, the base stays as loaded (stored in the compute dtype); its export
(the adapter and the head, and the merged critic) gives the trained values back, in transformers too;
CPU offload and gradient checkpointing change no update."""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPT_LENS, RESPONSE_LENS, algorithm, full_grads, random_batch

from ppo_trainer.config.schema import CriticConfig, LoraConfig, OptimConfig
from ppo_trainer.engine.critic import CriticEngine

LORA = LoraConfig(rank=4, alpha=8)
HEAD = ("value_head.weight", "value_head.bias")


def lora_critic(model_dir, dtype: str = "float32", lora: LoraConfig = LORA, **switches: bool) -> CriticEngine:
    cfg = CriticConfig(dtype=dtype, optim=OptimConfig(lr=1e-2), value_clip=None, lora=lora, **switches)
    return CriticEngine(cfg, model_dir, algorithm(), mini_batch_size=8)


@pytest.fixture(scope="module")
def batch():
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    return batch.with_fields(values=torch.zeros_like(batch.returns))


@pytest.fixture(scope="module")
def trained(tiny_model_dir, batch, tmp_path_factory):
    """(a LoRA critic after 3 updates: the head moves first, from zero, then the adapters; its state
    before them; the folder it saved critic/ and critic_merged/ into)."""
    critic = lora_critic(tiny_model_dir)
    initial = {k: v.clone() for k, v in critic.full_state_dict().items()}
    for _ in range(3):
        critic.update(batch)
    folder = tmp_path_factory.mktemp("checkpoint")
    critic.save_hf(folder / "critic", folder / "critic_merged")
    return critic, initial, folder


def test_only_the_adapters_and_the_value_head_train_and_the_base_stays_as_loaded(trained):
    critic, initial, _ = trained
    trainable = {name for name, p in critic.module.named_parameters() if p.requires_grad}
    assert set(HEAD) < trainable and all(".lora_" in name for name in trainable - set(HEAD))
    after = critic.full_state_dict()
    assert after.keys() == initial.keys()
    for key, value in after.items():
        moved = not torch.equal(value, initial[key])
        assert moved == (".lora_B" in key or ".lora_A" in key or key in HEAD), key


def test_the_export_gives_the_trained_values_back(trained, batch):
    from transformers import AutoModelForTokenClassification

    critic, _, folder = trained
    expected = critic.compute_values(batch)
    assert expected.abs().max() > 1e-2  # a trained head: the comparison is not between zeros
    P = batch.input_ids.shape[1] - batch.response_mask.shape[1]
    classifier = AutoModelForTokenClassification.from_pretrained(folder / "critic_merged", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = classifier(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits[..., 0]
    torch.testing.assert_close(logits[:, P - 1 : -1] * batch.response_mask, expected, atol=1e-5, rtol=0)
    # a critic started from either folder, full-parameter or with new adapters (B = 0) on top
    for start, lora in ((folder / "critic", LoraConfig()), (folder / "critic_merged", LORA)):
        torch.testing.assert_close(lora_critic(start, lora=lora).compute_values(batch), expected, atol=1e-5, rtol=0)


def test_a_bfloat16_lora_critic_stores_its_frozen_base_in_bfloat16_and_trains_in_float32(tiny_model_dir, batch):
    critic = lora_critic(tiny_model_dir, dtype="bfloat16")
    critic.update(batch)  # the head leaves zero: the next gradients reach the adapters
    critic.backward_mini_batch(batch, critic.micro_batch_loss, budget=10_000)
    grads = full_grads(critic.module)
    assert grads.keys() == {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().max() > 0 for name, g in grads.items() if "lora_B" in name)
    assert {(p.dtype, p.requires_grad) for p in critic.module.parameters()} == {(torch.bfloat16, False),
                                                                              (torch.float32, True)}


@pytest.mark.parametrize("switch", ["cpu_offload", "gradient_checkpointing"])
def test_memory_switches_give_the_same_updates(tiny_model_dir, batch, switch):
    states = []
    for on in (False, True):
        torch.manual_seed(0)  # the same LoRA A
        critic = lora_critic(tiny_model_dir, **{switch: on})
        for _ in range(2):  # the second reaches the adapters
            critic.update(batch)
        states.append(critic.full_state_dict())
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, atol=1e-7, rtol=0)
