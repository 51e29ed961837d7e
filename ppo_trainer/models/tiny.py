"""A tiny random Llama causal LM with a character-level tokenizer, built at run time for tests and
smoke runs (`model.path=random:tiny`): it loads through the Auto classes and vLLM, yet has ~100
tokens and ~0.1M parameters. And a tiny reward model whose score is a known function of the text
(`reward.model.path=random:tiny-reward`). Nothing is downloaded."""

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


def build_tiny_tokenizer(characters: str = CHARACTERS, chat_template: str = CHAT_TEMPLATE) -> Any:
    """A `PreTrainedTokenizerFast`, one token per character of `characters` (unknown ones: <unk>);
    `<|im_end|>` is eos and pad; by default the ChatML chat template (a generation prompt ends in
    "<|im_start|>assistant\\n")."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(characters))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges: one token per character
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=IM_START, eos_token=IM_END, pad_token=IM_END,
                                   unk_token=UNK, chat_template=chat_template, padding_side="left")


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


REWARD_DIGIT = "7"
# The reward model reads its own rendering of the conversation, which ends with the response's last
# character: the turns' contents one after another. Its vocabulary is the policy's in reverse order,
# so the two tokenizers give every character a different id.
REWARD_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tiny_reward_model(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny Llama sequence classifier (one label, float32) and its tokenizer into `folder`.
    Its score is 1 (to 1e-6) when the rendered text ends with `REWARD_DIGIT`, else exactly 0: every layer's
    output projections are zero, so the last position's state is its token's embedding; only that
    digit's embedding has a first component (c), and after the final RMSNorm (weight 1) that
    component is sqrt(hidden); the score head reads it with weight 1/sqrt(hidden)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = Path(folder)
    tokenizer = build_tiny_tokenizer(CHARACTERS[::-1], REWARD_CHAT_TEMPLATE)
    special_ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    config = LlamaConfig(vocab_size=len(tokenizer), num_labels=1, **special_ids, **TINY_ARCHITECTURE)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config).to(torch.float32)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0] = 0.0
        embeddings[tokenizer.convert_tokens_to_ids(REWARD_DIGIT), 0] = 10.0  # large against RMSNorm's eps
        embeddings[tokenizer.convert_tokens_to_ids(REWARD_DIGIT), 1:] = 0.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = config.hidden_size**-0.5
    model.save_pretrained(folder)  # creates the folder
    tokenizer.save_pretrained(folder)
    return folder
