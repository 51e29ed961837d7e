"""Hugging Face exports: a state dict as safetensors takes it (a checkpoint's files, the bytes of a
weight push to a rollout engine) and a model folder (config.json + model.safetensors) that
transformers and vLLM load as they are."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import torch


def safetensors_ready(state: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """`state` as safetensors takes it (a file or the bytes of a weight push): detached, on CPU,
    contiguous, floating tensors cast to `dtype`; tensors sharing storage (tied embeddings) cloned."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        value = value.detach().to("cpu")
        value = (value.to(dtype) if dtype is not None and value.is_floating_point() else value).contiguous()
        ptr = value.untyped_storage().data_ptr()
        out[key] = value.clone() if ptr in seen else value
        seen.add(ptr)
    return out


def save_hf_weights(folder: Path, config: Any, state: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None,
                    keep_dtype: Optional[dict[str, torch.Tensor]] = None, **config_updates: Any) -> None:
    """config.json (a copy of `config` with `config_updates`) + model.safetensors for `state` (HF key
    names), floats cast to `dtype`; the tensors of `keep_dtype` are added as they are (e.g. a float32 head)."""
    from safetensors.torch import save_file

    config = copy.deepcopy(config)
    config.update(config_updates if dtype is None else {**config_updates, "dtype": dtype})
    config.save_pretrained(folder)
    tensors = {**safetensors_ready(state, dtype), **safetensors_ready(keep_dtype or {})}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def merge_adapter(adapter: Path, base_dir: Path, scratch: Path) -> Path:
    """The LoRA adapter folder `adapter` merged into its base model (the folder `base_dir`), saved with
    its tokenizer as a model folder under `scratch`; returns it."""
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      str(adapter)).merge_and_unload()
    out = Path(tempfile.mkdtemp(prefix="merged-", dir=scratch))
    model.save_pretrained(out)
    tokenizer_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
