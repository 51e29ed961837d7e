"""A tiny random Llama causal LM with a character-level tokenizer, built at run time for tests and
smoke runs (`model.path=random:tiny`): it loads through the Auto classes and vLLM, yet has ~100
tokens and ~0.1M parameters. Nothing is downloaded."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (UNK, IM_START, IM_END)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n\t"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 2,  # head size 32: vLLM accepts 32, 64, 80, 96, 112, 128, ...
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def build_tiny_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast`, one token per character (unknown ones: <unk>); `<|im_end|>` is
    eos and pad; ChatML chat template (a generation prompt ends in "<|im_start|>assistant\\n")."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges: one token per character
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=IM_START, eos_token=IM_END, pad_token=IM_END,
                                   unk_token=UNK, chat_template=CHAT_TEMPLATE, padding_side="left")


def build_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Write a random tiny Llama model (float32) and its tokenizer into `folder`; return it. The
    weights depend only on `seed`; the global torch RNG is left untouched."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = build_tiny_tokenizer()
    special_ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    config = LlamaConfig(vocab_size=len(tokenizer), **special_ids, **TINY_ARCHITECTURE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(**special_ids)
    model.save_pretrained(folder)  # creates the folder
    tokenizer.save_pretrained(folder)
    return folder
