"""The per-device work of each role: plain classes, built from the full config, usable in-process
(local backend) or inside a Ray actor (ray backend, one instance per device and rank).

Data layout (what a WorkerGroup sends each replica): `update` takes the full batch on every rank
(the engine deals each mini-batch's rows); `compute_*` and `generate` take that replica's rows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from ppo_trainer.batch import Batch
from ppo_trainer.config import batch_arithmetic, optimizer_steps, uses_reference


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None


def release_freed_host_memory() -> None:
    """Hand the host memory that freed tensors leave inside glibc's heap back to the system.

    An update allocates and frees thousands of activation and gradient tensors below glibc's mmap
    threshold; the freed chunks stay in the heap, fragmented, so the resident size of a CPU run
    climbs step after step although the live tensors do not. `malloc_trim(0)` releases every free
    page of the heap. A no-op where the C library has no malloc_trim (not glibc).
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def replica_seed(seed: int, replica: int) -> int:
    """The seed of replica `replica` of a call seeded with `seed`: `seed` itself for replica 0 (so
    a one-replica run samples what it always did), a distinct deterministic seed for the others."""
    if replica == 0:
        return seed
    return (seed + replica * 0x9E3779B1) % (2**31 - 1)  # golden-ratio stride: spread, below 2**31


class RngState:
    """A role's part of the exact-resume state: the torch RNG states of its process (CPU, and
    every visible CUDA device), which dropout (e.g. model.lora.dropout) draws from.

    Roles seed their process from trainer.seed twice: before building, so that every rank and
    every run builds the same random initial weights (LoRA's A matrices), and after, per rank
    (`replica_seed`), so that ranks draw different dropout masks. A fresh worker process does
    not start from a reproducible RNG state by itself."""

    @staticmethod
    def seed_rng(seed: int, rank: Optional[int] = None) -> None:
        torch.manual_seed(seed if rank is None else replica_seed(seed, rank))  # CPU and every CUDA device

    def rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class ActorRole(RngState):
    """The policy (and the reference policy) on one device."""

    def __init__(self, cfg: DictConfig, device: str):
        from ppo_trainer.engine.actor import ActorEngine
        from ppo_trainer.models.loading import resolve_model_path

        self.seed_rng(cfg.trainer.seed)
        self.engine = ActorEngine(
            cfg.model,
            resolve_model_path(cfg.model.path),
            cfg.algorithm,
            mini_batch_size=batch_arithmetic(cfg)["sequences_per_mini_batch"],
            temperature=cfg.sampler.temperature,
            top_k=cfg.sampler.top_k,
            top_p=cfg.sampler.top_p,
            use_reference=uses_reference(cfg),
            device=device,
            total_steps=optimizer_steps(cfg, "actor"),
            seed=cfg.trainer.seed,
        )
        self.seed_rng(cfg.trainer.seed, self.engine.rank)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.engine.compute_logprobs(batch)

    def compute_logprobs_and_entropy(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.compute_logprobs_and_entropy(batch)

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.engine.compute_ref_logprobs(batch)

    def update(self, batch: Batch) -> dict[str, float]:
        metrics = self.engine.update(batch)
        release_freed_host_memory()
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout engine (rank 0; {} elsewhere); LoRA merged."""
        return self.engine.full_state_dict()

    def save(self, checkpoint: str) -> None:
        """HF export into <checkpoint>/actor (LoRA: also the merged model in actor_merged), resume
        state into <checkpoint>/state/actor."""
        self.engine.save_hf(Path(checkpoint) / "actor", Path(checkpoint) / "actor_merged")
        self.engine.save_state(Path(checkpoint) / "state" / "actor")

    def load(self, checkpoint: str) -> None:
        self.engine.load_state(Path(checkpoint) / "state" / "actor")


class CriticRole(RngState):
    """The value model on one device."""

    def __init__(self, cfg: DictConfig, device: str):
        from ppo_trainer.checkpoint import checkpoint_part
        from ppo_trainer.engine.critic import CriticEngine
        from ppo_trainer.models.loading import resolve_model_path

        self.seed_rng(cfg.trainer.seed)
        self.engine = CriticEngine(
            cfg.critic,
            resolve_model_path(checkpoint_part(cfg.critic.path, "critic") if cfg.critic.path else cfg.model.path),
            cfg.algorithm,
            mini_batch_size=batch_arithmetic(cfg)["sequences_per_mini_batch"],
            device=device,
            total_steps=optimizer_steps(cfg, "critic"),
            seed=cfg.trainer.seed,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.seed_rng(cfg.trainer.seed, self.engine.rank)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.engine.compute_values(batch)

    def update(self, batch: Batch) -> dict[str, float]:
        metrics = self.engine.update(batch)
        release_freed_host_memory()
        return metrics

    def save(self, checkpoint: str) -> None:
        """HF export into <checkpoint>/critic, resume state into <checkpoint>/state/critic."""
        self.engine.save_hf(Path(checkpoint) / "critic")
        self.engine.save_state(Path(checkpoint) / "state" / "critic")

    def load(self, checkpoint: str) -> None:
        self.engine.load_state(Path(checkpoint) / "state" / "critic")


class RolloutRole(RngState):
    """One rollout engine (HF generate or vLLM) with its own copy of the policy weights."""

    def __init__(self, cfg: DictConfig, device: str, initial_weights: Optional[str] = None):
        from ppo_trainer.models.loading import resolve_model_path
        from ppo_trainer.rollout import build_sampler

        self.sampler = build_sampler(
            cfg.sampler,
            initial_weights or resolve_model_path(cfg.model.path),
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            # room for validation's responses too (eval.max_new_tokens may exceed the sampler's)
            max_prompt_length=cfg.data.max_prompt_length + max(0, cfg.eval.max_new_tokens - cfg.sampler.max_new_tokens),
            colocate=cfg.devices.colocate,
            device=device,
            trust_remote_code=cfg.model.trust_remote_code,
        )

    def generate(self, batch: Batch, n: int, seed: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None) -> Batch:
        return self.sampler.generate(batch, n, seed=seed, greedy=greedy, max_new_tokens=max_new_tokens)

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.sampler.sync_weights(state_dict)
        release_freed_host_memory()

    def sleep(self) -> None:
        self.sampler.sleep()

    def wake(self) -> None:
        self.sampler.wake()

    @property
    def supports_sleep(self) -> bool:
        return self.sampler.supports_sleep


ROLE_CLASSES: dict[str, Any] = {"actor": ActorRole, "critic": CriticRole, "rollout": RolloutRole}
