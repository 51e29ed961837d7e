"""ValueModel: V(s_t) alignment, shapes, zero-initialised head, save/load round trip (as a Hugging
Face token-classification model, and the older backbone + value_head format); LoRA: test_lora_critic_folder."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_trainer.models import critic as critic_module
from ppo_trainer.models.critic import VALUE_HEAD_CONFIG, ValueModel


def make_batch(rows: list[tuple[list[int], list[int]]], pad_id: int = 0):
    P = max(len(p) for p, _ in rows)
    T = max(len(r) for _, r in rows)
    ids = torch.full((len(rows), P + T), pad_id)
    attn = torch.zeros(len(rows), P + T, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P] = torch.tensor(p)
        ids[i, P : P + len(r)] = torch.tensor(r)
        attn[i, P - len(p) : P + len(r)] = 1
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0), attn[:, P:]  # the response mask


PROMPT, RESPONSE = [5, 9, 14, 3], [20, 21, 22, 23]
ROWS = [(PROMPT, RESPONSE), ([7, 8], [30, 31])]


@pytest.fixture(scope="module")
def value_model(tiny_model_dir):
    model = ValueModel.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():  # a non-zero head, so values carry information
        model.value_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        model.value_head.bias.fill_(0.25)
    return model


def test_fresh_head_is_zero_so_first_values_are_zero(tiny_model_dir):
    model = ValueModel.from_pretrained(tiny_model_dir)
    ids, attn, pos, mask = make_batch(ROWS)
    with torch.no_grad():
        values = model(ids, attn, pos, mask)
    assert values.shape == mask.shape and values.dtype == torch.float32
    assert torch.all(values == 0)


def test_value_of_token_t_is_read_from_the_state_before_t(value_model):
    """values[t] = head(hidden at P+t-1): the backbone run on prompt + response[:t] alone."""
    ids, attn, pos, mask = make_batch(ROWS)
    with torch.no_grad():
        values = value_model(ids, attn, pos, mask)
        for t in range(len(RESPONSE)):
            prefix = torch.tensor([PROMPT + RESPONSE[:t]])
            hidden = value_model.backbone(input_ids=prefix).last_hidden_state[0, -1]
            expected = value_model.value_head(hidden)[0]
            torch.testing.assert_close(values[0, t], expected, atol=1e-5, rtol=0)


def test_changing_response_token_t_changes_values_after_t_only(value_model):
    ids, attn, pos, mask = make_batch(ROWS)
    P = ids.shape[1] - mask.shape[1]
    changed = ids.clone()
    changed[0, P + 1] = 40  # response token t = 1
    with torch.no_grad():
        before = value_model(ids, attn, pos, mask)
        after = value_model(changed, attn, pos, mask)
    assert torch.equal(before[0, :2], after[0, :2])  # V(s_0), V(s_1): chosen before token 1 is seen
    assert torch.all((before[0, 2:] - after[0, 2:]).abs() > 1e-6)
    assert torch.equal(before[1], after[1])


def test_left_padding_does_not_change_values(value_model):
    ids, attn, pos, mask = make_batch(ROWS)
    alone_ids, alone_attn, alone_pos, alone_mask = make_batch(ROWS[1:])
    with torch.no_grad():
        padded = value_model(ids, attn, pos, mask)[1, :2]
        alone = value_model(alone_ids, alone_attn, alone_pos, alone_mask)[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_save_and_reload_give_the_same_weights_and_values(value_model, tmp_path):
    value_model.save_pretrained(tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1
    reloaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    for key, value in value_model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    ids, attn, pos, mask = make_batch(ROWS)
    with torch.no_grad():  # float32 kernels may round differently on differently aligned copies
        torch.testing.assert_close(reloaded(ids, attn, pos, mask), value_model(ids, attn, pos, mask), atol=1e-6, rtol=0)


def test_saved_value_model_loads_as_token_classification_with_the_same_values(value_model, tmp_path):
    from transformers import AutoModelForTokenClassification

    value_model.save_pretrained(tmp_path / "critic")
    classifier = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    ids, attn, pos, mask = make_batch(ROWS)
    P = ids.shape[1] - mask.shape[1]
    with torch.no_grad():
        logits = classifier(input_ids=ids, attention_mask=attn, position_ids=pos).logits  # [B, P+T, 1]
        torch.testing.assert_close(logits[:, P - 1 : -1, 0] * mask, value_model(ids, attn, pos, mask), atol=1e-5,
                                   rtol=0)


def test_the_older_folder_format_still_loads(value_model, tmp_path, monkeypatch):
    """Model types without a token-classification class are saved as backbone + value_head files,
    the format of earlier checkpoints; both load with the head."""
    monkeypatch.setattr(critic_module, "token_classifier_class", lambda config: None)
    value_model.save_pretrained(tmp_path / "critic")
    assert json.loads((tmp_path / "critic" / VALUE_HEAD_CONFIG).read_text())["hidden_size"] == 64
    reloaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    ids, attn, pos, mask = make_batch(ROWS)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, attn, pos, mask), value_model(ids, attn, pos, mask))


def test_backbone_of_a_saved_value_model_loads_with_automodel(value_model, tmp_path):
    from transformers import AutoModel

    value_model.save_pretrained(tmp_path / "critic")
    backbone = AutoModel.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    for key, value in value_model.backbone.state_dict().items():
        assert torch.equal(backbone.state_dict()[key], value)


def test_an_actors_lora_adapter_is_rejected_for_the_critic_before_it_loads(tiny_model_dir, tmp_path):
    """An adapter without a value head (a LoRA actor's) is no critic; a LoRA critic's is (test_lora_critic_folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppo_trainer.models.loading import model_path_problem

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="a LoRA adapter without a value head"):
        ValueModel.from_pretrained(tmp_path / "adapter")
    assert "actor_merged" in model_path_problem(str(tmp_path / "adapter"), "critic.path", part="critic")


def test_a_critic_started_from_a_reward_model_takes_its_backbone_and_score_head(tmp_path):
    """OpenRLHF's default start: V(s_t) is the reward model's score head read at every state (the
    reward model reads it at the last one)."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from ppo_trainer.models.loading import REWARD_MODEL_HEAD, value_head_origin
    from ppo_trainer.models.tiny import TINY_ARCHITECTURE

    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(vocab_size=40, num_labels=1, pad_token_id=0, **TINY_ARCHITECTURE)
                                   ).save_pretrained(tmp_path / "rm")
    assert value_head_origin(str(tmp_path / "rm")) == REWARD_MODEL_HEAD
    assert value_head_origin("random:tiny-reward") == REWARD_MODEL_HEAD
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    critic = ValueModel.from_pretrained(tmp_path / "rm").eval()
    assert torch.equal(critic.value_head.weight, reward_model.score.weight) and critic.value_head.bias.item() == 0.0
    backbone = dict(critic.backbone.state_dict())
    assert all(torch.equal(backbone[k], v) for k, v in reward_model.model.state_dict().items())
    ids = torch.tensor([[5, 9, 12, 7, 33]])
    with torch.no_grad():
        scores = [reward_model(input_ids=ids[:, : k + 1]).logits[0, 0].item() for k in range(5)]
        values = critic(ids, torch.ones_like(ids), torch.arange(5)[None], torch.ones(1, 3, dtype=torch.long))
    # P = 2 prompt tokens, T = 3 response tokens: V(s_t) reads the state at P + t - 1 = 1, 2, 3
    assert values[0].tolist() == pytest.approx(scores[1:4], abs=1e-5)
