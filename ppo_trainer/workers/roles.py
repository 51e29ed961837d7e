"""Each role's engine, built from the full config, and `Worker`: one engine in one process, what
a backend drives (the local backend holds one, the Ray backend one per Ray actor)."""

from __future__ import annotations

import gc
import inspect
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from omegaconf import DictConfig

from ppo_trainer.config.derived import batch_arithmetic, optimizer_steps, response_budget, uses_reference
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine
from ppo_trainer.engine.reward_model import RewardModelEngine
from ppo_trainer.errors import RunError
from ppo_trainer.models.loading import resolve_model_path
from ppo_trainer.rollout import PartialSampler, Sampler, build_sampler
from ppo_trainer.run.checkpoint import write_manifest
from ppo_trainer.workers.cluster.nodes import folder_problem, this_node
from ppo_trainer.workers.cluster.placement import DISTRIBUTED_ROLES
from ppo_trainer.workers.process_tuning import bound_cpu_kernel_caches, keep_freed_host_memory


def replica_seed(seed: int, replica: int) -> int:
    """`seed` for replica 0 (a one-replica run samples what it always did), a distinct one for the others."""
    if replica == 0:
        return seed
    return (seed + replica * 0x9E3779B1) % (2**31 - 1)  # golden-ratio stride: spread, below 2**31


def build_actor(cfg: DictConfig, device: str) -> ActorEngine:
    """The policy (and the reference policy) on `device`."""
    return ActorEngine(
        cfg.model, resolve_model_path(cfg.model.path), cfg.algorithm,
        mini_batch_size=batch_arithmetic(cfg)["sequences_per_mini_batch"],
        temperature=cfg.sampler.temperature, top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p,
        use_reference=uses_reference(cfg), device=device, total_steps=optimizer_steps(cfg, "actor"),
        seed=cfg.trainer.seed, correct_score=cfg.reward.correct_score,
    )


def build_critic(cfg: DictConfig, device: str) -> CriticEngine:
    """The value model on `device`: from `critic.path` (a checkpoint's critic/ folder too), else the actor's model."""
    path = resolve_model_path(cfg.critic.path, part="critic") if cfg.critic.path else resolve_model_path(cfg.model.path)
    return CriticEngine(
        cfg.critic, path, cfg.algorithm, mini_batch_size=batch_arithmetic(cfg)["sequences_per_mini_batch"],
        device=device, total_steps=optimizer_steps(cfg, "critic"), seed=cfg.trainer.seed,
        attn_implementation=cfg.model.attn_implementation, trust_remote_code=cfg.model.trust_remote_code,
    )


def build_rollout(cfg: DictConfig, device: str) -> Sampler:
    """The `sampler.name` engine with its own copy of the policy weights (vLLM: sleep mode when colocated)."""
    s = cfg.sampler
    return build_sampler(
        s, resolve_model_path(cfg.model.path), dtype=cfg.model.dtype, seed=cfg.trainer.seed,
        # room for validation's responses too (eval.max_new_tokens per turn may exceed the sampler's)
        max_prompt_length=cfg.data.max_prompt_length + max(0, response_budget(s, cfg.eval.max_new_tokens)
                                                            - response_budget(s)),
        colocate=cfg.devices.colocate, device=device, trust_remote_code=cfg.model.trust_remote_code,
        chat_template_kwargs=dict(cfg.data.chat_template_kwargs),
    )


def build_reward_model(cfg: DictConfig, device: str) -> RewardModelEngine:
    """The reward model (`reward.model.*`) on `device`, in its own dtype, tokenizer and chat template."""
    r = cfg.reward.model
    return RewardModelEngine(resolve_model_path(r.path), dtype=r.dtype, device=device,
                             token_budget=cfg.algorithm.ppo_micro_batch_tokens, trust_remote_code=r.trust_remote_code)


def accelerator_backends() -> list[tuple[str, Any]]:
    """(name, torch module) of the accelerators this process sees: torch.cuda, torch.npu (torch_npu)."""
    found = [("cuda", torch.cuda)] if torch.cuda.is_available() else []
    npu = getattr(torch, "npu", None)  # registered by torch_npu, Ascend's adapter
    if npu is not None and npu.is_available():
        found.append(("npu", npu))
    return found


class WorkerError(RunError):
    """A worker of a group failed or hung; the message names the role, the rank and its own error."""


class SharedFolderError(RuntimeError):
    """A worker does not see the checkpoint folder the driver staged; the message names its node and the folder."""


BUILDERS = {"actor": build_actor, "critic": build_critic, "rollout": build_rollout, "reward_model": build_reward_model}
# The class whose methods a role's worker runs besides its own (`Worker.OWN_METHODS`); the rollout's
# is the protocol every sampler follows (`Sampler`) and the label only partial rollouts call.
ENGINES: dict[str, type] = {"actor": ActorEngine, "critic": CriticEngine, "rollout": PartialSampler,
                            "reward_model": RewardModelEngine}


class BusyClock:
    """The seconds during which at least one call ran: calls side by side (partial rollouts' rollout
    worker runs a weight push beside a generation, each on a thread of its own) count once."""

    def __init__(self) -> None:
        self.seconds = 0.0  # busy since the last `take`
        self.running, self.since = 0, time.perf_counter()  # calls running now; when that count last changed
        self.lock = threading.Lock()

    def change(self, calls: int) -> None:
        """`calls` more (+1: one starts) or fewer (-1: one ends) calls running from now on."""
        with self.lock:
            self._advance()
            self.running += calls

    def take(self) -> float:
        """The busy seconds since the last `take`, the calls still running counted up to now."""
        with self.lock:
            self._advance()
            seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _advance(self) -> None:
        """Count the time since the last change if a call ran through it (the caller holds the lock)."""
        now = time.perf_counter()
        if self.running:
            self.seconds += now - self.since
        self.since = now


class Worker:
    """One replica of `role`: `call` runs the engine's method, or one of `OWN_METHODS`. Actor and
    critic seed the process before building (every rank builds the same initial weights, e.g.
    LoRA's A), then per rank (`replica_seed`: different dropout masks)."""

    OWN_METHODS = ("save", "load", "rng_state", "set_rng_state", "push_weights", "peak_memory_gb", "release_memory",
                   "busy_seconds")

    def __init__(self, role: str, cfg: DictConfig, device: str):
        bound_cpu_kernel_caches()
        if torch.device(device).type == "cpu":  # its activations and gradients live in host memory
            keep_freed_host_memory()
        self.role = role
        self.busy = BusyClock()
        seeded = role in DISTRIBUTED_ROLES
        if seeded:
            torch.manual_seed(cfg.trainer.seed)  # CPU and every CUDA device
        self.engine = BUILDERS[role](cfg, device)
        if seeded:
            torch.manual_seed(replica_seed(cfg.trainer.seed, self.engine.rank))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method`, a name from `method_name` (Ray calls an actor's methods by name), timed into
        `busy_seconds`; not `push_weights`, which mostly waits for the rollout workers to take them."""
        target = self if method in self.OWN_METHODS else self.engine
        timed = method != "push_weights"
        if timed:
            self.busy.change(+1)
        try:
            return getattr(target, method)(*args, **kwargs)
        finally:
            if timed:
                self.busy.change(-1)

    def busy_seconds(self) -> float:
        """Seconds this worker spent in calls since the last `busy_seconds` (`BusyClock.take`; the
        `perf/<role>/idle_share` metrics: how much of the time a pool waits)."""
        return self.busy.take()

    def save(self, checkpoint: str, marker: str) -> None:
        """HF export into <checkpoint>/<role> (with LoRA: merged into <role>_merged too), resume state,
        and this rank's manifest of what it wrote (`checkpoint.verify` reads it before the commit).
        First, the staged folder must be the driver's: it holds the `marker` token the driver wrote
        (`cluster.write_marker`), else SharedFolderError and nothing is written."""
        root = Path(checkpoint)
        problem = folder_problem(root, marker)
        if problem:
            raise SharedFolderError(f"{this_node()} {problem}")
        merged = f"{self.role}_merged"  # written by a LoRA engine only; the manifest lists the folders there are
        self.engine.save_hf(root / self.role, root / merged)
        self.engine.save_state(root / "state" / self.role)
        write_manifest(root, self.role, self.engine.rank, [self.role, merged, f"state/{self.role}"])

    def load(self, checkpoint: str) -> None:
        self.engine.load_state(Path(checkpoint) / "state" / self.role)

    def push_weights(self, receivers: Sequence[Any], bucket_bytes: int) -> int:
        """Stream the actor's weights (`ActorEngine.weight_buckets`, a collective of the actor's ranks)
        from rank 0 straight into the rollout workers `receivers` (`WorkerGroup.receivers`): a Worker
        of this process gets each bucket handed over, Ray workers fetch it from the object store in
        parallel; the driver never holds a copy. A receiver is one replica, tensor-parallel ones too: it
        gets full layers, which each of its engine's ranks shards as it loads them. Returns the bytes
        sent to each receiver (tensor bytes in the compute dtype; `perf/sync_bytes`)."""
        sent = 0
        for bucket in self.engine.weight_buckets(bucket_bytes):
            local = [r for r in receivers if isinstance(r, Worker)]
            remote = [r for r in receivers if not isinstance(r, Worker)]
            load = method_name("rollout", Sampler.load_weight_bucket, (bucket,))
            for receiver in local:
                receiver.call(load, bucket)
            if remote:
                import ray

                ref = ray.put(bucket)  # one copy in the object store, whatever the number of replicas
                ray.get([r.call.remote(load, ref) for r in remote])
            sent += sum(t.numel() * t.element_size() for t in bucket.values())
        return sent

    def peak_memory_gb(self, reset: bool = False) -> float:
        """This process's peak memory in GiB: on CUDA the allocator's peak (`reset`: from now on, per
        step), else the peak resident set (since the process started: it cannot be reset)."""
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**30
            if reset:
                torch.cuda.reset_peak_memory_stats()
            return peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    def release_memory(self) -> None:
        """Hand the allocator's cached, unused accelerator memory back (before a colocated vLLM engine
        wakes into the same devices; another process's cache would be out of its reach)."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        elif hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            torch.npu.empty_cache()  # type: ignore[attr-defined]

    def rng_state(self) -> dict[str, Any]:
        """The process's generators: the CPU's, and every visible CUDA or Ascend device's."""
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        for name, backend in accelerator_backends():
            state[name] = backend.get_rng_state_all()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        for name, backend in accelerator_backends():
            if name in state:
                backend.set_rng_state_all(state[name])


def method_name(role: str, method: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Optional[Mapping[str, Any]] = None) -> str:
    """The name under which a `role` worker runs `method` (`Worker.call`): the one place a method of the
    seam between driver and workers becomes a name. `method` is the function itself, `Worker.save` or
    e.g. `ActorEngine.update`: one of `Worker.OWN_METHODS` or of the role's `ENGINES` class, and `args`
    and `kwargs` must bind to its signature. So a renamed or misspelt method, one of another role, or
    arguments it does not take fail here, in the driver, before any worker runs."""
    name = getattr(method, "__name__", "")
    owner = Worker if name in Worker.OWN_METHODS else ENGINES[role]
    if getattr(owner, name, None) is not method:
        raise TypeError(f"{getattr(method, '__qualname__', repr(method))} is not a method the {role} workers run: "
                        f"pass one of {owner.__name__}'s, or of Worker's {', '.join(Worker.OWN_METHODS)}")
    try:
        inspect.signature(method).bind(None, *args, **(kwargs or {}))
    except TypeError as e:
        raise TypeError(f"{owner.__name__}.{name} on the {role} workers: {e}") from None
    return name
