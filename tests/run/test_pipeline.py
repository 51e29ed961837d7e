"""`run.pipeline.RolloutPipeline` against a scripted slow rollout worker: one thread that runs its calls
in the order they arrive, as a Ray actor does, whose sampler writes the version of the weights it holds
into every sampled logprob. So a sample's recorded `policy_version` can be checked against the weights
that really sampled it, and the staleness against the fixed lag."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.core.staleness import behaviour_step, staleness_metrics, token_staleness_metrics
from ppo_trainer.data import PromptRecord
from ppo_trainer.rollout.base import assemble_rollout
from ppo_trainer.run.pipeline import RolloutPipeline, draw_seed, step_seed
from ppo_trainer.workers.pending import Pending

PROMPTS, N = 2, 2
TOKENS = 5  # per sample of the scripted partial rollouts


class ScriptedRollout:
    """A rollout group of one replica: calls queue on one thread; `generate` takes `delay_s` and
    samples token `seed % 100` with logprob -(weights version); `push` loads a version. `events` is
    the order in which calls were submitted and began. `partial`: a partial rollouts' engine, whose
    `generate` samples TOKENS tokens one by one, each with the weights held then (its logprob and
    `token_version` say which), and whose `push` loads at once, beside the generation in flight."""

    def __init__(self, delay_s: float = 0.05, partial: bool = False):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.weights = 0
        self.delay_s = delay_s
        self.partial = partial
        self.events: list[str] = []
        self.lock = threading.Lock()

    def log(self, event: str) -> None:
        with self.lock:
            self.events.append(event)

    def submit_split(self, method, prompts: Batch, n: int, seed: int) -> Pending[Batch]:
        assert method.__name__ == "generate"
        self.log(f"submit {seed}")

        def generate() -> Batch:
            self.log(f"generate {seed}")
            rows = len(prompts) * n
            if not self.partial:
                time.sleep(self.delay_s)
                return assemble_rollout(prompts, n, [[seed % 100]] * rows, [[-float(self.weights)]] * rows,
                                        [True] * rows, ["x"] * rows, pad_id=0)
            versions = []
            for _ in range(TOKENS):
                time.sleep(self.delay_s / TOKENS)
                versions.append(self.weights)
            return assemble_rollout(prompts, n, [[seed % 100] * TOKENS] * rows, [[-float(v) for v in versions]] * rows,
                                    [True] * rows, ["x"] * rows, pad_id=0, versions=[versions] * rows)

        return Pending(self.pool.submit(generate).result)

    def push(self, version: int) -> None:
        if self.partial:
            self.weights = version  # at once: the generation in flight continues with these weights
        else:
            self.pool.submit(setattr, self, "weights", version).result()  # behind the queued generations


def records(step: int) -> list[PromptRecord]:
    return [PromptRecord(index=i, question=f"q{step}.{i}", prompt=f"q{step}.{i}", prompt_ids=(5, 6 + i),
                         ground_truth=str(step), data_source="toy", extra_info={"step": step})
            for i in range(PROMPTS)]


def loader(after: int = 0):
    """Each step's prompts in order, from step `after` + 1 (a resumed loader's position)."""
    step = after
    while True:
        step += 1
        yield records(step)


def train(pipeline: RolloutPipeline, rollout: ScriptedRollout, steps: range, train_s: float = 0.01) -> dict[int, Batch]:
    """The trainer's use: take the step's rollout, train (here: a pause of `train_s`), push the new weights."""
    taken = {}
    for step in steps:
        got_records, batch = pipeline.take(step)
        assert [r.extra_info["step"] for r in got_records] == [step] * PROMPTS  # the loader's order
        rollout.log(f"train {step}")
        time.sleep(train_s)
        rollout.push(step)
        pipeline.push_done(step)
        taken[step] = batch
    return taken


def run(k: int, steps: int = 6, delay_s: float = 0.05, partial: bool = False,
        train_s: float = 0.01) -> tuple[dict[int, Batch], ScriptedRollout]:
    rollout = ScriptedRollout(delay_s, partial)
    pipeline = RolloutPipeline(rollout, loader(), pad_id=0, n=N, seed=7, max_staleness=k, last_step=steps)
    return train(pipeline, rollout, range(1, steps + 1), train_s), rollout


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_every_sample_records_the_weights_that_sampled_it_on_the_fixed_lag(k):
    taken, _ = run(k)
    for step, batch in taken.items():
        sampled_with = -batch.sample_logprobs[:, 0]  # the scripted sampler's weights at generation
        assert torch.equal(batch.policy_version.float(), sampled_with)
        assert batch.policy_version.tolist() == [behaviour_step(step, k)] * (PROMPTS * N)
        assert batch.response_ids[:, 0].tolist() == [step_seed(7, step) % 100] * (PROMPTS * N)
        metrics = staleness_metrics(step, batch.policy_version)
        assert metrics["rollout/staleness/max"] == min(step - 1, k) <= k
        assert metrics["rollout/staleness/mean"] == metrics["rollout/staleness/max"]
    assert staleness_metrics(1, taken[1].policy_version)["rollout/staleness/max"] == 0


@pytest.mark.parametrize("k", [1, 2])
def test_partial_rollouts_record_each_tokens_weights_never_staler_than_the_lag(k):
    """A push lands while the next generation runs (training here is shorter than a generation): the
    tokens after it are sampled with the new weights, and say so."""
    # a generation starts as the step before it is taken; 100 ms a token and 250 ms of training: the push
    # lands between its second and third token, with 100 ms of slack either way on a busy machine
    taken, _ = run(k, steps=6, delay_s=0.5, partial=True, train_s=0.25)
    cut = 0.0
    for step, batch in taken.items():
        versions = batch.token_version
        assert torch.equal(versions.float(), -batch.sample_logprobs)  # each token: the weights that sampled it
        assert (versions >= batch.policy_version[:, None]).all()  # from the weights the sample started with on
        assert batch.policy_version.tolist() == [behaviour_step(step, k)] * (PROMPTS * N)
        metrics = token_staleness_metrics(step, versions, batch.response_mask)
        assert metrics["rollout/staleness/max"] <= min(step - 1, k)
        cut = max(cut, metrics["rollout/staleness/cut_share"])
    assert cut == 1.0, "no step's samples were cut by a push"


def test_lag_0_is_lock_step_and_lag_1_generates_the_next_batch_before_training():
    _, lock_step = run(0, steps=3)
    assert [e.split()[0] for e in lock_step.events] == ["submit", "generate", "train"] * 3
    _, lagged = run(1, steps=3)
    seeds = [step_seed(7, s) for s in (1, 2, 3)]
    submitted = [e for e in lagged.events if e.startswith(("submit", "train"))]
    assert submitted == [f"submit {seeds[0]}", f"submit {seeds[1]}", "train 1", f"submit {seeds[2]}", "train 2",
                         "train 3"]  # never past trainer.total_steps


def test_the_saved_rollouts_resume_to_the_uninterrupted_run():
    """Saved after step 3 of a k=2 run (steps 4 and 5 generated ahead), a new pipeline on restored
    weights trains on exactly what the uninterrupted run trained on."""
    k, steps = 2, 7
    expected, _ = run(k, steps)
    rollout = ScriptedRollout()
    first = RolloutPipeline(rollout, loader(), pad_id=0, n=N, seed=7, max_staleness=k, last_step=steps)
    train(first, rollout, range(1, 4))
    saved = first.state()
    assert [s["step"] for s in saved] == [4, 5]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as the checkpoint stores them: plain containers and tensors

    rollout = ScriptedRollout()
    rollout.push(3)  # the resume pushes the checkpoint's weights
    second = RolloutPipeline(rollout, loader(after=5), pad_id=0, n=N, seed=7, max_staleness=k, last_step=steps)
    second.resume_at(3, saved)
    got = train(second, rollout, range(4, steps + 1))
    for step in range(4, steps + 1):
        for name in ("input_ids", "sample_logprobs", "policy_version", "response_mask"):
            assert torch.equal(getattr(got[step], name), getattr(expected[step], name)), (step, name)
        assert got[step].extra_info == expected[step].extra_info


def test_a_partial_rollout_saved_in_flight_resumes_with_its_tokens_versions():
    rollout = ScriptedRollout(partial=True)
    first = RolloutPipeline(rollout, loader(), pad_id=0, n=N, seed=7, max_staleness=1, last_step=6)
    train(first, rollout, range(1, 4))
    buffer = io.BytesIO()
    torch.save(first.state(), buffer)  # step 4's rollout: started with step 2's weights, cut by step 3's push
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    second = RolloutPipeline(ScriptedRollout(partial=True), loader(after=4), pad_id=0, n=N, seed=7, max_staleness=1,
                             last_step=6)
    second.resume_at(3, saved)
    _, batch = second.take(4)
    assert torch.equal(batch.token_version, saved[0]["batch"]["token_version"])
    assert set(batch.token_version.flatten().tolist()) <= {2, 3} and batch.policy_version.tolist() == [2] * 4


def test_a_resume_without_saved_rollouts_samples_fresher_never_staler():
    """A run that ended at step 3 and is extended: steps 4-5 sample with step 3's weights."""
    rollout = ScriptedRollout()
    rollout.push(3)
    pipeline = RolloutPipeline(rollout, loader(after=3), pad_id=0, n=N, seed=7, max_staleness=2, last_step=8)
    pipeline.resume_at(3, [])
    taken = train(pipeline, rollout, range(4, 9))
    assert {s: int(b.policy_version[0]) for s, b in taken.items()} == {4: 3, 5: 3, 6: 3, 7: 4, 8: 5}


def test_saved_rollouts_for_other_steps_are_refused():
    pipeline = RolloutPipeline(ScriptedRollout(), loader(), pad_id=0, n=N, seed=7, max_staleness=1, last_step=8)
    with pytest.raises(ValueError, match=r"saved rollouts are for steps \[5\], not the next <= 1 after step 3"):
        pipeline.resume_at(3, [{"step": 5, "records": [], "batch": {}}])


def test_a_push_out_of_schedule_is_caught_before_generating():
    rollout = ScriptedRollout()
    pipeline = RolloutPipeline(rollout, loader(), pad_id=0, n=N, seed=7, max_staleness=1, last_step=5)
    pipeline.take(1)
    pipeline.push_done(1)  # step 2's generation went out at step 1's start; step 3 samples with step 1's
    pipeline.take(2)
    pipeline.push_done(2)
    pipeline.push_done(3)  # a step pushed twice ahead: step 4 would sample with step 3's weights
    with pytest.raises(RuntimeError, match="step 4 would sample with the weights after step 3, but "
                                           "sampler.max_staleness=1 schedules those after step 2"):
        pipeline.take(3)


def test_an_extra_draw_takes_the_next_prompts_with_the_seed_of_step_and_draw():
    rollout = ScriptedRollout(delay_s=0)
    pipeline = RolloutPipeline(rollout, loader(), pad_id=0, n=N, seed=7, max_staleness=0, last_step=4)
    pipeline.take(1)
    rollout.push(1)
    pipeline.push_done(1)
    got_records, batch = pipeline.draw(1, 1)
    assert [r.extra_info["step"] for r in got_records] == [2] * PROMPTS  # the loader's next prompts
    assert batch.response_ids[:, 0].tolist() == [draw_seed(7, 1, 1) % 100] * (PROMPTS * N)
    assert batch.policy_version.tolist() == [1] * (PROMPTS * N)
    assert draw_seed(7, 1, 0) == step_seed(7, 1) and len({draw_seed(7, s, d) for s in range(50) for d in range(10)}) == 500


def test_an_extra_draw_is_refused_with_rollouts_generated_ahead():
    pipeline = RolloutPipeline(ScriptedRollout(delay_s=0), loader(), pad_id=0, n=N, seed=7, max_staleness=1, last_step=4)
    with pytest.raises(RuntimeError, match="sampler.max_staleness=0"):
        pipeline.draw(1, 1)
