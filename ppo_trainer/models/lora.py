"""LoRA adapters (peft) on a transformers model, for the actor (model.lora) and the critic (critic.lora):
injection, the merge of a trained adapter into its base weights, and the adapter's files."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ppo_trainer.config.schema import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"  # peft's: marks an adapter folder
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def add_lora(model: nn.Module, lora: LoraConfig, task_type: Optional[str]) -> nn.Module:
    """`model` wrapped as a peft `PeftModel` with adapters of `lora` on its `target_modules`: the
    base frozen, the adapters trainable, in float32 (peft upcasts them over a half-precision base),
    LoRA B at zero (the wrapped model computes what `model` did)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    return get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                target_modules=list(lora.target_modules), bias="none",
                                                task_type=task_type))


def lora_scalings(peft_model: nn.Module) -> dict[str, tuple[float, bool]]:
    """(scaling = alpha / r, fan_in_fan_out) per adapted module, keyed by its name in `peft_model`."""
    from peft.tuners.lora import LoraLayer

    return {name: (float(module.scaling["default"]), bool(getattr(module, "fan_in_fan_out", False)))
            for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer) and "default" in module.scaling}


def merge_lora_state_dict(state: dict[str, torch.Tensor],
                          scalings: dict[str, tuple[float, bool]]) -> dict[str, torch.Tensor]:
    """A `PeftModel.state_dict()` -> the merged base model's: W = W_base + scaling * B @ A; keys
    lose the "base_model.model." prefix and the ".base_layer" infix, LoRA matrices are dropped."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        wrapped, _, leaf = key.rpartition(".")
        module = wrapped.removesuffix(".base_layer")
        if module != wrapped and leaf == "weight" and module in scalings:
            scaling, fan_in_fan_out = scalings[module]
            delta = state[f"{module}.lora_B.default.weight"] @ state[f"{module}.lora_A.default.weight"]
            value = value + scaling * (delta.T if fan_in_fan_out else delta)
        merged[f"{module}.{leaf}".removeprefix("base_model.model.")] = value
    return merged


def save_adapter(peft_model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """peft's adapter folder (adapter_config.json, adapter_model.safetensors) of `peft_model` with the
    weights of `state` (keys as in `peft_model.state_dict()`, e.g. gathered from FSDP shards), as
    `PeftModel.from_pretrained` reads it."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    # the frozen base's embedding matrices stay out: peft's "auto" looks for a resized vocabulary in the
    # base's config.json, which a LoRA critic's base (another LoRA critic) does not have
    adapter = get_peft_model_state_dict(peft_model, state_dict=state, save_embedding_layers=False)
    peft_model.peft_config["default"].save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in adapter.items()}, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
