"""Training engine: FSDP2-sharded actor (`engine.actor`) and critic (`engine.critic`) on the shared
machinery of `engine.fsdp`; micro-batching, optimizer, collectives."""
