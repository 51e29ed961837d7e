"""Training engine: FSDP2-sharded actor and critic, micro-batching, optimizer, checkpoints.

`ActorEngine` and `CriticEngine` are what the roles call; `FSDPEngine` is the shared machinery.
"""

from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine
from ppo_trainer.engine.fsdp import FSDPEngine

__all__ = ["ActorEngine", "CriticEngine", "FSDPEngine"]
