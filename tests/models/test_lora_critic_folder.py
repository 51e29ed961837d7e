"""A LoRA critic's folder (critic.lora.rank > 0; `ValueModel.save_lora`: peft's adapter files and the
value head's) and its merged export: both load with the values of the model that saved them, in
transformers too; critic.path takes the folder (its base from adapter_config.json, checked before any
model loads), a checkpoint's global_step_N its merged export; a critic trained on a LoRA critic names it
as its base."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ppo_trainer.config.schema import LoraConfig
from ppo_trainer.models.critic import ValueModel
from ppo_trainer.models.loading import (
    SAVED_CRITIC_HEAD,
    ModelPathError,
    local_config,
    model_path_problem,
    resolve_model_path,
    value_head_origin,
)

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def trained_lora_critic(base, seed: int = 0) -> ValueModel:
    """A LoRA critic on `base` whose adapters and head hold random values, as if trained."""
    model = ValueModel.from_pretrained(base)
    model.add_lora(LORA, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # LoRA A and B, the value head
                param.normal_(0, 0.2, generator=generator)
    return model.eval()


def batch():
    """input_ids, attention_mask, position_ids [2, 9] (left-padded prompts of up to 5 tokens, right-padded
    responses of up to 4) and response_mask [2, 4]."""
    ids = torch.tensor([[5, 9, 14, 3, 8, 20, 21, 22, 23], [0, 0, 7, 8, 6, 30, 31, 0, 0]])
    attn = (ids != 0).long()
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0), attn[:, 5:]


def values(model: ValueModel) -> torch.Tensor:
    with torch.no_grad():
        return model(*batch())


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """(the model, a checkpoint-like global_step_3 folder with its critic/ and critic_merged/)."""
    model = trained_lora_critic(tiny_model_dir)
    step = tmp_path_factory.mktemp("run") / "global_step_3"
    model.save_lora(step / "critic")
    model.save_pretrained(step / "critic_merged")
    return model, step


def test_the_folder_holds_the_adapter_and_the_head_and_trains_them_alone(saved, tiny_model_dir):
    model, step = saved
    assert sorted(p.name for p in (step / "critic").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "value_head.json", "value_head.safetensors"]
    adapter = json.loads((step / "critic" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir) and adapter["r"] == 4
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} < trainable
    assert all(".lora_" in name for name in trainable - {"value_head.weight", "value_head.bias"})


def test_both_folders_load_with_the_values_of_the_model_that_saved_them(saved):
    model, step = saved
    expected = values(model)
    assert expected.abs().max() > 0.1  # the adapter and the head are not zero: the comparison means something
    for folder in (step / "critic", step / "critic_merged"):
        torch.testing.assert_close(values(ValueModel.from_pretrained(folder).eval()), expected, atol=1e-5, rtol=0)


def test_the_merged_export_is_a_token_classifier_transformers_loads_as_it_is(saved):
    from transformers import AutoModelForTokenClassification

    model, step = saved
    classifier = AutoModelForTokenClassification.from_pretrained(step / "critic_merged", dtype=torch.float32).eval()
    ids, attn, pos, mask = batch()
    with torch.no_grad():
        logits = classifier(input_ids=ids, attention_mask=attn, position_ids=pos).logits[..., 0]
    torch.testing.assert_close(logits[:, 4:-1] * mask, values(model), atol=1e-5, rtol=0)


def test_critic_path_takes_the_folder_and_a_step_folder_its_merged_export(saved, tiny_model_dir):
    _, step = saved
    assert resolve_model_path(str(step / "critic"), part="critic") == step / "critic"
    assert resolve_model_path(str(step), part="critic") == step / "critic_merged"  # needs no base
    assert value_head_origin(str(step / "critic")) == SAVED_CRITIC_HEAD
    assert local_config(str(step / "critic"), "critic") == json.loads((tiny_model_dir / "config.json").read_text())


def test_a_lora_critic_whose_base_is_gone_is_refused_before_any_model_loads(saved, tmp_path):
    _, step = saved
    moved = tmp_path / "critic"
    shutil.copytree(step / "critic", moved)
    adapter = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": "/no/base"}))
    problem = model_path_problem(str(moved), "critic.path", part="critic")
    assert "base model '/no/base'" in problem and "critic_merged" in problem
    with pytest.raises(ModelPathError, match="/no/base"):
        ValueModel.from_pretrained(moved)


def test_a_critic_trained_on_a_lora_critic_names_it_as_its_base(saved, tmp_path):
    """Its adapter is relative to the first one merged into the base: loading it applies both."""
    first, step = saved
    second = ValueModel.from_pretrained(step / "critic")
    second.add_lora(LORA, torch.float32)
    torch.testing.assert_close(values(second.eval()), values(first), atol=1e-5, rtol=0)  # B = 0: the same model
    with torch.no_grad():
        for name, param in second.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    second.save_lora(tmp_path / "critic")
    adapter = json.loads((tmp_path / "critic" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(step / "critic")
    torch.testing.assert_close(values(ValueModel.from_pretrained(tmp_path / "critic").eval()), values(second),
                               atol=1e-5, rtol=0)
