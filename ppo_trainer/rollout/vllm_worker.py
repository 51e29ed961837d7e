"""vLLM worker extension: receives the actor's weights and reloads them into the running engine.

vLLM mixes this class into its worker when the engine is built with
`worker_extension_cls="ppo_trainer.rollout.vllm_worker.WeightSyncExtension"`; the sampler calls
its methods with `LLM.collective_rpc`. This module must not import vLLM itself: it is imported by
the worker process to build the mixed-in class.
"""

from __future__ import annotations

import safetensors.torch


class WeightSyncExtension:
    """Methods run inside each vLLM worker (`self` is the worker)."""

    def ppo_load_weights(self, blob: bytes) -> int:
        """Reload all weights from a safetensors byte blob in HF checkpoint names; returns their count.

        The weights go through the worker's `reload_weights` (not `model.load_weights`), which
        repeats the loader's post-processing (e.g. the CPU backend's weight repacking). Bytes,
        not tensors, cross the process boundary: tensors arrive as lists in multi-process mode.
        """
        state = safetensors.torch.load(blob)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(state)
