"""`RolloutPipeline`: each step's rollout, generated on the lag schedule of `sampler.max_staleness`
(`core.staleness`; docs/async.md). With k = 0 a step submits its own generation and waits for it,
the lock-step loop. With k >= 1 step s first submits the generations of the steps up to s+k, then
takes its own, generated earlier: the rollout workers generate the next batch while the actor and
critic train on this one, and the weight push at the end of the step waits for that generation.

Why the version is known: a rollout worker runs its calls one at a time in the order they reach it
(one Ray actor per replica), and step t's generation is submitted at step t-k's start (step 1's for
t <= k+1): after the push of step t-1-k's update, whose weights it must use, and before the push of
step t-k's, whose it must not. So a generation samples with the last weights pushed before it was
submitted, which `push_done` records, and every sample's `policy_version` says so.

With partial rollouts (sampler.partial_rollouts) the push does not wait for the generation in flight: it
pauses it, and the generation continues with the new weights (`rollout.vllm_partial`). `policy_version`
stays the weights a sample started with, and each token records those that sampled it
(`Batch.token_version`, the engine's label of each push: `PartialSampler.set_policy_version`)."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.core.staleness import behaviour_step
from ppo_trainer.data import PromptRecord
from ppo_trainer.evaluate import prompt_batch
from ppo_trainer.rollout import Sampler
from ppo_trainer.workers.group import WorkerGroup
from ppo_trainer.workers.pending import Pending


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step: fixed by (trainer.seed, step), so a resumed run samples
    what the uninterrupted run sampled (an engine's RNG state cannot be checkpointed)."""
    return draw_seed(seed, step, 0)


def draw_seed(seed: int, step: int, draw: int) -> int:
    """The sampling seed of a step's draw (draw 0: the step's own rollout; 1, 2, ...: the extra draws
    of algorithm.filter_groups), fixed by (trainer.seed, step, draw) for the same reason."""
    return (seed * 1_000_003 + step * 7_919 + draw * 15_485_863) % (2**31 - 1)


@dataclass
class Rollout:
    """One step's generation: its prompts' records and the rollout (`Pending` until taken)."""

    step: int
    records: list[PromptRecord]
    batch: Pending[Batch]


class RolloutPipeline:
    """The rollouts of steps `taken + 1 ..`: submitted ahead up to k steps, never past `last_step`
    (trainer.total_steps: a run stopped early and resumed generates what the uninterrupted run did).

    `rollout`: the rollout group; `loader`: the training prompts, one step's records per `next`;
    `n`: samples per prompt; `seed`: trainer.seed; `max_staleness`: k."""

    def __init__(self, rollout: WorkerGroup, loader: Iterator[list[PromptRecord]], *, pad_id: int, n: int,
                 seed: int, max_staleness: int, last_step: int):
        self.rollout, self.loader = rollout, loader
        self.pad_id, self.n, self.seed, self.k, self.last_step = pad_id, n, seed, max_staleness, last_step
        self.in_flight: deque[Rollout] = deque()
        self.next_step = 1  # the next step whose generation is submitted
        self.weights_version = 0  # the rollout workers hold the policy after this step
        self.oldest_version = 0  # no generation can use older weights (a resume's step)

    def resume_at(self, step: int, saved: list[dict[str, Any]]) -> None:
        """After a resume from step `step`, whose weights the workers hold (just pushed): the rollouts
        in flight at the save (`state()`: steps step+1, step+2, ...) come back, to be taken first. Where
        the save had none (the run had ended; trainer.total_steps has grown since), steps up to step+1+k
        sample with step `step`'s weights: fresher than the schedule, never staler."""
        expected = list(range(step + 1, step + 1 + len(saved)))
        if [s["step"] for s in saved] != expected or len(saved) > self.k:
            raise ValueError(f"the saved rollouts are for steps {[s['step'] for s in saved]}, not the next "
                             f"<= {self.k} after step {step}")
        self.in_flight.clear()
        for s in saved:
            batch = Batch(**s["batch"])
            records = [PromptRecord(**{**r, "prompt_ids": tuple(r["prompt_ids"])}) for r in s["records"]]
            self.in_flight.append(Rollout(s["step"], records, Pending(lambda batch=batch: batch)))
        self.next_step = step + 1 + len(saved)
        self.weights_version = self.oldest_version = step

    def take(self, step: int) -> tuple[list[PromptRecord], Batch]:
        """Submit the generations of steps up to step+k, then wait for step `step`'s: its records
        and its rollout, each row's `policy_version` set ([B] int64: the weights that sampled it)."""
        while self.next_step <= min(step + self.k, self.last_step):
            self._submit(self.next_step)
        rollout = self.in_flight.popleft()
        if rollout.step != step:
            raise RuntimeError(f"the rollout pipeline holds step {rollout.step}'s rollout, not step {step}'s")
        return rollout.records, rollout.batch.result()

    def draw(self, step: int, draw: int) -> tuple[list[PromptRecord], Batch]:
        """An extra draw for step `step` (algorithm.filter_groups, lock-step only): the loader's next
        prompts, generated now with the seed of (step, draw) and the weights the workers hold. The
        loader's position, saved with the checkpoint, counts it, so a resume draws what this run did."""
        if self.k != 0 or self.in_flight:
            raise RuntimeError(f"an extra draw for step {step} needs lock-step rollouts (sampler.max_staleness=0)")
        rollout = self._generate(step, draw_seed(self.seed, step, draw))
        return rollout.records, rollout.batch.result()

    def _submit(self, step: int) -> None:
        version, scheduled = self.weights_version, max(behaviour_step(step, self.k), self.oldest_version)
        if version != scheduled:  # the schedule is a function of the step alone
            raise RuntimeError(f"step {step} would sample with the weights after step {version}, but "
                               f"sampler.max_staleness={self.k} schedules those after step {scheduled}")
        self.in_flight.append(self._generate(step, step_seed(self.seed, step)))
        self.next_step += 1

    def _generate(self, step: int, seed: int) -> Rollout:
        """The loader's next prompts submitted to the rollout workers under `seed`; each row's
        `policy_version` is the weights the workers hold now (the last push before this submit)."""
        records, version = next(self.loader), self.weights_version
        pending = self.rollout.submit_split(Sampler.generate, prompt_batch(records, self.pad_id), self.n, seed=seed)
        return Rollout(step, records, pending.then(
            lambda batch: batch.with_fields(policy_version=torch.full((len(batch),), version, dtype=torch.long))))

    def push_done(self, step: int) -> None:
        """The workers now hold the policy after step `step` (its update pushed; unchanged weights, as
        in a critic warm-up, count as pushed): generations submitted from now on use it."""
        self.weights_version = step

    def state(self) -> list[dict[str, Any]]:
        """The rollouts in flight, waited for (a save stores them: a resume trains on them first):
        [{"step", "records": [PromptRecord fields], "batch": {field: value}}], in step order.
        Plain containers and tensors only, which `torch.load(weights_only=True)` reads back."""
        saved = []
        for rollout in self.in_flight:
            batch = rollout.batch.result()
            rollout.batch = Pending(lambda batch=batch: batch)  # waited once; taken later from memory
            saved.append({"step": rollout.step, "records": [dataclasses.asdict(r) for r in rollout.records],
                          "batch": {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
                                    if getattr(batch, f.name) is not None}})
        return saved
