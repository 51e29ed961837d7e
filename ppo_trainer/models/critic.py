"""The value model: a transformer backbone plus a Linear(hidden, 1) value head.

values[:, t] = V(s_t), the value of the state *before* response token t, read from the hidden
state at P+t-1 (as the policy's logits; at P+t the critic would see the action it evaluates).

Folder format: a Hugging Face token-classification model with one label, as verl saves its critic
(head as `score.weight` [1, H] / `score.bias` [1]); for a model type without such a class, a
backbone folder plus `value_head.safetensors` and `value_head.json`. A LoRA critic (critic.lora.rank
> 0, adapters on the backbone, the head trained in full) saves peft's adapter files plus the head's
(`save_lora`; its base is the folder the backbone loaded from), and its merged weights in the first
format. The head starts at zeros: the first values are exactly 0, not seed-dependent noise; it still
learns from step one (gradient dL/dV * hidden), the backbone once the head is non-zero."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ppo_trainer.config.schema import LoraConfig
from ppo_trainer.models.export import save_hf_weights
from ppo_trainer.models.loading import (
    ADAPTER_CONFIG,
    REWARD_MODEL_HEAD,
    VALUE_HEAD_CONFIG,
    lora_critic_base,
    value_head_origin,
)
from ppo_trainer.models.lora import add_lora, lora_scalings, merge_lora_state_dict, save_adapter
from ppo_trainer.models.packing import Layout, layout_for, on_response_tokens, states_before_response_tokens

VALUE_HEAD_WEIGHTS = "value_head.safetensors"


class ValueModel(nn.Module):
    """V(s_t) of every response token; the head computes in float32 whatever the backbone's dtype."""

    def __init__(self, backbone: nn.Module, value_head: Optional[nn.Linear] = None) -> None:
        super().__init__()
        self.backbone = backbone
        if value_head is None:
            value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head
        self.pack_sequences = False  # algorithm.pack_sequences, set by the engine that trains it

    @property
    def is_lora(self) -> bool:
        return hasattr(self.backbone, "peft_config")

    @property
    def hf_backbone(self) -> nn.Module:
        """The transformers base model (with LoRA layers injected, when there is an adapter)."""
        return self.backbone.get_base_model() if self.is_lora else self.backbone

    @classmethod
    def from_pretrained(cls, path: str | Path, *, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                        gradient_checkpointing: bool = False) -> "ValueModel":
        """A saved value model (any format), a reward model (a sequence classifier with one label:
        its backbone, and its score head as the value head), or any causal-LM / base-model folder with
        a zero head (`value_head_origin`), in float32 (the master copy; FSDP casts for compute)."""
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

        path = Path(path)
        if (path / ADAPTER_CONFIG).is_file():
            return cls._from_lora_critic(path, attn_implementation=attn_implementation,
                                         trust_remote_code=trust_remote_code,
                                         gradient_checkpointing=gradient_checkpointing)
        kwargs = dict(dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        head = None
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        saved_critic = any(a.endswith("ForTokenClassification") for a in architectures)
        if saved_critic or value_head_origin(str(path)) == REWARD_MODEL_HEAD:  # OpenRLHF's default start
            auto = AutoModelForTokenClassification if saved_critic else AutoModelForSequenceClassification
            classifier = auto.from_pretrained(path, **kwargs)
            backbone, score = getattr(classifier, classifier.base_model_prefix), classifier.score
            if score.out_features != 1:
                raise ValueError(f"critic.path '{path}' is a classifier with {score.out_features} labels; a value "
                                 "model (or a reward model to start it from) has num_labels=1")
            head = nn.Linear(score.in_features, 1, dtype=torch.float32)  # the value head has a bias; a score may not
            with torch.no_grad():
                head.weight.copy_(score.weight.float())
                head.bias.copy_(score.bias.float() if score.bias is not None else torch.zeros(1))
        else:
            backbone = AutoModel.from_pretrained(path, **kwargs)
        backbone.config.use_cache = False
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = cls(backbone, head)
        model.load_value_head(path)
        return model

    @classmethod
    def _from_lora_critic(cls, folder: Path, **options: bool | str) -> "ValueModel":
        """A LoRA critic's folder (`save_lora`): its base critic with the adapter merged into the
        backbone, and its value head: where a new run starts, not an adapter it goes on training."""
        from peft import PeftModel

        model = cls.from_pretrained(lora_critic_base(folder), **options)
        model.backbone = PeftModel.from_pretrained(model.backbone, str(folder)).merge_and_unload()
        # what peft records as the base of an adapter trained on top: this folder, not the one beneath
        model.backbone.name_or_path = str(folder)
        model.load_value_head(folder)
        return model

    def load_value_head(self, folder: Path) -> None:
        """The head of `folder`'s `value_head.safetensors` where it has one (`VALUE_HEAD_CONFIG`), in float32."""
        from safetensors.torch import load_file

        if (folder / VALUE_HEAD_CONFIG).is_file():
            weights = load_file(folder / VALUE_HEAD_WEIGHTS)
            self.value_head.load_state_dict({k: v.float() for k, v in weights.items()})

    def add_lora(self, lora: LoraConfig, base_dtype: torch.dtype) -> None:
        """Adapters of `lora` on the backbone (`models.lora.add_lora`), its frozen base stored in
        `base_dtype`; the value head stays float32 and trainable (peft freezes what it wraps only)."""
        self.backbone = add_lora(self.backbone.to(base_dtype), lora, task_type="FEATURE_EXTRACTION")

    def decoder_layers(self) -> list[nn.Module]:
        """The transformer blocks, the units FSDP shards separately."""
        return list(self.hf_backbone.get_decoder().layers)

    @property
    def layout(self) -> Layout:
        """How its forwards lay out the rows (`models.packing`)."""
        return layout_for(self.hf_backbone, self.pack_sequences)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_mask: torch.Tensor,
                with_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """values [B, T] float32 from input_ids, attention_mask, position_ids [B, P+T] and response_mask
        [B, T] (T >= 1, P >= 1); 0 where response_mask is 0. `with_states`: (values, the [N, H]
        states the head read, one per valid response token in the row-major order of the mask), what a
        fit of the head regresses on (`core.value_fit`); through forward, so FSDP gathers the weights."""
        states = states_before_response_tokens(self.hf_backbone, input_ids, attention_mask, position_ids,
                                               response_mask, self.layout)
        values = on_response_tokens(self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1), response_mask)
        return (values, states) if with_states else values

    def save_pretrained(self, folder: str | Path, state_dict: Optional[dict[str, torch.Tensor]] = None,
                        dtype: Optional[torch.dtype] = None) -> None:
        """Write the folder format of the module docstring, a LoRA adapter merged into the backbone.
        `state_dict` (keys as in `self.state_dict()`, e.g. gathered from FSDP shards) replaces the
        module's own tensors; `dtype` casts the backbone (the head is always saved in float32)."""
        folder = Path(folder)  # save_hf_weights creates it
        backbone, head = self._split(self.state_dict() if state_dict is None else state_dict)
        if self.is_lora:
            backbone = merge_lora_state_dict(backbone, lora_scalings(self.backbone))
        config = self.hf_backbone.config
        classifier = token_classifier_class(config)
        if classifier is not None:
            save_hf_weights(folder, config, {f"{classifier.base_model_prefix}.{k}": v for k, v in backbone.items()},
                            dtype, keep_dtype={f"score.{k}": v for k, v in head.items()},
                            architectures=[classifier.__name__], num_labels=1)
            return
        save_hf_weights(folder, config, backbone, dtype)
        self._save_value_head(folder, head)

    def save_lora(self, folder: str | Path, state_dict: Optional[dict[str, torch.Tensor]] = None) -> None:
        """A LoRA critic's folder: peft's adapter files (the adapter in float32, the folder the backbone
        loaded from as its base) and the value head's; `state_dict` as for `save_pretrained`."""
        folder = Path(folder)
        backbone, head = self._split(self.state_dict() if state_dict is None else state_dict)
        save_adapter(self.backbone, backbone, folder)
        self._save_value_head(folder, head)

    @staticmethod
    def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the backbone's tensors, the head's in float32) of a `state_dict()`, without their module prefix."""
        backbone = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
        head = {k[len("value_head.") :]: v.float().contiguous() for k, v in state.items()
                if k.startswith("value_head.")}
        return backbone, head

    @staticmethod
    def _save_value_head(folder: Path, head: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file(head, folder / VALUE_HEAD_WEIGHTS)
        info = {"format": "ppo_trainer.value_model/1", "hidden_size": int(head["weight"].shape[1]), "init": "zeros"}
        (folder / VALUE_HEAD_CONFIG).write_text(json.dumps(info, indent=2) + "\n")


def token_classifier_class(config: object) -> Optional[type]:
    """transformers' `<Model>ForTokenClassification` class for this config's model type, if any."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    name = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return getattr(transformers, name, None) if name else None
