"""vLLM worker extension (`worker_extension_cls`, called through `LLM.collective_rpc`): reloads
the actor's weights into the running engine. Must not import vLLM: the worker imports it to build
the mixed-in class."""

from __future__ import annotations

import safetensors.torch


class WeightSyncExtension:
    """Methods run inside each vLLM worker (`self` is the worker)."""

    def ppo_load_weights(self, blob: bytes) -> int:
        """Reload all weights from a safetensors blob (HF names); returns their count. `reload_weights`
        repeats the loader's post-processing (the CPU backend's repacking); bytes, not tensors, cross
        the process boundary (tensors arrive as lists in multi-process mode)."""
        state = safetensors.torch.load(blob)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(state)
