"""The PPO loop (one step: `Trainer.train_step`). The driver holds no model: it moves `Batch`es
between the worker groups and calls `ppo_trainer.core` for the math."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from ppo_trainer.agents import load_multi_turn
from ppo_trainer.batch import Batch
from ppo_trainer.config.derived import kl_in_reward, response_budget, uses_ground_truth, uses_reference
from ppo_trainer.config.paths import absolute_paths
from ppo_trainer.config.trust import code_overrides
from ppo_trainer.console import console_stream, run_summary
from ppo_trainer.core import advantages
from ppo_trainer.core.critic_warmup import CriticWarmup, deciding_explained_var
from ppo_trainer.core.kl_control import AdaptiveKL, FixedKL
from ppo_trainer.core.masked import masked_mean
from ppo_trainer.core.metrics import logprob_gap_metrics
from ppo_trainer.core.rollout_correction import rollout_weights
from ppo_trainer.core.staleness import staleness_metrics, token_staleness_metrics
from ppo_trainer.data import PromptLoader, PromptRecord, load_prompts
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine
from ppo_trainer.errors import InputError, NonFiniteError, RunError, StoppedBySignal
from ppo_trainer.evaluate import (
    eval_temperature,
    evaluate_records,
    reward_inputs,
    validation_metrics,
    validation_seed,
)
from ppo_trainer.rewards import shaping
from ppo_trainer.rewards.loader import answer_check
from ppo_trainer.rewards.math import EXTRACTORS
from ppo_trainer.rewards.scoring import (
    CombinedScorer,
    Scorer,
    function_scorers,
    require_finite_scores,
    reward_metrics,
    scorers_of,
)
from ppo_trainer.rollout import PartialSampler, Sampler
from ppo_trainer.rollout.multi_turn import multi_turn_metrics
from ppo_trainer.run import checkpoint, resume, trainer_state
from ppo_trainer.run import folder as run_folder
from ppo_trainer.run.filtering import Draw, fill_groups
from ppo_trainer.run.pipeline import RolloutPipeline
from ppo_trainer.tracking import Tracker
from ppo_trainer.workers import watchdog
from ppo_trainer.workers.group import WorkerGroup, device_count
from ppo_trainer.workers.roles import Worker, WorkerError

log = logging.getLogger("ppo_trainer")


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class Trainer:
    """Drives one PPO run; see the module docstring for the step."""

    def __init__(self, cfg: DictConfig, groups: dict[str, WorkerGroup], pad_id: int,
                 train_records: list[PromptRecord], val_records: list[PromptRecord],
                 scorers: Optional[tuple[CombinedScorer, Scorer]] = None):
        self.cfg = cfg
        self.groups = groups
        self.actor, self.critic, self.rollout = groups["actor"], groups.get("critic"), groups["rollout"]
        self.pad_id = pad_id
        self.val_records = val_records
        self.output_dir = Path(cfg.trainer.output_dir)
        self.loader = PromptLoader.from_config(cfg, train_records)
        self.rollouts = RolloutPipeline(self.rollout, self.loader, pad_id=pad_id, n=cfg.sampler.n, seed=cfg.trainer.seed,
                                        max_staleness=cfg.sampler.max_staleness, last_step=cfg.trainer.total_steps)
        self.train_data = resume.data_fingerprint(train_records)  # a resume checks that the prompts are the same
        # training's (reward.fn and the learned rewards) and validation's (eval.reward_fn, else reward.fn)
        self.scorer, self.val_scorer = scorers or scorers_of(cfg, groups)
        g = cfg.gae
        self.kl_ctrl = AdaptiveKL(g.kl_coef, g.kl_target, g.kl_horizon) if g.kl_ctrl == "adaptive" else FixedKL(g.kl_coef)
        self.critic_warmup = CriticWarmup(cfg.algorithm.critic_warmup, cfg.algorithm.critic_warmup_explained_var)
        self.uses_reference = uses_reference(cfg)
        self.kl_in_reward = kl_in_reward(cfg)
        self.step = 0
        self.nonfinite_streak = {"actor": 0, "critic": 0, "kl_ctrl": 0}  # PPO steps in a row with skipped updates
        self.best: Optional[dict[str, Any]] = None  # {"step", "value"}: the best validated objective so far
        self._stop_requested: Optional[str] = None  # the name of the signal that asked to stop
        self._stop_deadline: Optional[threading.Timer] = None
        self.perf_clock = time.perf_counter()  # the idle shares count from here (`fit` restarts it)

    @classmethod
    def from_config(cls, cfg: DictConfig, command: Sequence[str] = ()) -> "Trainer":
        """The resume is checked (`ppo_trainer.run.resume`), data and reward loaded, config.yaml written
        and `command` (the command line, masked) recorded before any model loads; then the groups.
        The caller holds the output folder."""
        from ppo_trainer.models.loading import check_critic_vocabulary, load_tokenizer
        from ppo_trainer.workers.group import build_groups

        output_dir = Path(cfg.trainer.output_dir)
        resumed = trainer_state.prepare_resume(cfg, output_dir)
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        if cfg.critic.path:
            check_critic_vocabulary(cfg.critic.path, tokenizer)
        # a bad environment, tool or tool template fails here, before the models load
        tools = load_multi_turn(cfg.sampler.multi_turn, tokenizer, dict(cfg.data.chat_template_kwargs))[1]
        answers = uses_ground_truth(cfg)  # an RLHF dataset without answers trains on a reward model or server
        train_records = load_prompts(cfg.data, tokenizer, "train", answers, answer_check(cfg, "train"), tools)
        val_records = load_prompts(cfg.data, tokenizer, "val", answers, answer_check(cfg, "val"), tools)
        if resumed is not None:
            trainer_state.check_resumed_data(resumed, train_records, cfg)
        functions = function_scorers(cfg)  # a bad reward.fn or signature fails here, before the models load
        try:
            run_folder.write_config(output_dir, cfg, command)
            groups = build_groups(cfg)
        except BaseException:
            for scorer in functions:
                if scorer is not None:
                    scorer.close()
            raise
        trainer = cls(cfg, groups, tokenizer.pad_token_id, train_records, val_records,
                      scorers_of(cfg, groups, functions))
        if resumed is not None:
            trainer_state.load(trainer, resumed)
        return trainer

    def fit(self) -> Optional[float]:
        """Run to trainer.total_steps (or stop_after_steps); returns the last trainer.objective value."""
        t = self.cfg.trainer
        started, first_step = time.time(), self.step
        tracker = Tracker(self.output_dir, list(t.loggers), t.total_steps, self.step,
                          OmegaConf.to_container(self.cfg), t.experiment_name)
        objective: Optional[float] = None
        objective_step: Optional[int] = None
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        for group in self.groups.values():  # the idle shares count from here (`perf_metrics`)
            group.run_all(Worker.busy_seconds)
        self.perf_clock = time.perf_counter()
        try:
            if self.step == 0:
                metrics = self.validate()
                tracker.log(0, metrics)
                if t.objective in metrics:
                    objective, objective_step = metrics[t.objective], 0
            last = min(t.total_steps, t.stop_after_steps or t.total_steps)
            while self.step < last:
                self.step += 1
                metrics, samples = self.train_step(self.step)
                validated = self.step == t.total_steps or (t.val_every and self.step % t.val_every == 0)
                if validated:
                    metrics.update(self.validate())
                tracker.log(self.step, metrics)
                tracker.log_samples(self.step, samples)
                if t.objective in metrics:
                    objective, objective_step = metrics[t.objective], self.step
                best = bool(validated) and self.record_best(metrics.get(t.objective))
                stopping = self._stop_requested is not None or self.step == last
                if best or stopping or (t.save_every and self.step % t.save_every == 0):
                    trainer_state.save(self, best=best)
                if self._stop_requested is not None:
                    log.warning("%s received: saved step %d; rerun the same command to continue",
                                self._stop_requested, self.step)
                    break
        except WorkerError as e:
            if self._stop_requested is None:
                raise  # run_training adds the last checkpoint
            raise StoppedBySignal(  # a scheduler signals every process of the job, the workers too
                f"{self._stop_requested} stopped the workers during step {self.step} ({e}); "
                f"{self.last_checkpoint_line()}", signal.Signals[self._stop_requested]) from e
        finally:
            if self._stop_deadline is not None:
                self._stop_deadline.cancel()
            for s, handler in previous.items():
                signal.signal(s, handler)
            tracker.close()
        best_run = self.best or {}
        best_step = checkpoint.pointed_step(self.output_dir, "best")
        summary = run_summary(
            self.output_dir, steps=(first_step, self.step, t.total_steps), seconds=time.time() - started,
            objective_name=t.objective, final=(objective_step, objective),
            best=(best_run.get("step"), best_run.get("value")),
            best_dir=None if best_step is None else checkpoint.step_dir(self.output_dir, best_step),
            last_dir=checkpoint.last_complete(self.output_dir), stopped_by=self._stop_requested,
            eval_overrides=code_overrides(self.cfg))
        print(summary, file=console_stream(), flush=True)
        run_folder.write_summary(self.output_dir, summary)
        return objective

    def record_best(self, value: Optional[float]) -> bool:
        """True (and remembered) when a validated objective beats the best so far (NaN never does)."""
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        maximize = self.cfg.trainer.objective_direction == "maximize"
        better = self.best is None or (value > self.best["value"] if maximize else value < self.best["value"])
        if better:
            self.best = {"step": self.step, "value": float(value)}
        return better

    def _request_stop(self, signum: int, _frame: Any) -> None:
        """SIGINT, SIGTERM: finish the step and save; a second signal, or the step still running
        trainer.worker_timeout_s later, stops at once (exit 130) with the last checkpoint intact."""
        if self._stop_requested is not None:
            raise KeyboardInterrupt  # a second signal: stop now, the last checkpoint stays intact
        name = self._stop_requested = signal.Signals(signum).name
        timeout = self.cfg.trainer.worker_timeout_s
        log.warning("%s: finishing step %d, then saving a checkpoint (send again to abort)", name, self.step)
        self._stop_deadline = watchdog.start(
            timeout, lambda: f"{name}: step {self.step} did not finish and save within trainer.worker_timeout_s="
                             f"{timeout:g} s; {self.last_checkpoint_line()}", code=130, stacks=False)

    def last_checkpoint_line(self) -> str:
        return checkpoint.last_checkpoint_line(self.output_dir)

    def train_step(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """One PPO step; returns its metrics and a few samples for samples.jsonl."""
        cfg, a, timer = self.cfg, self.cfg.algorithm, _Timer()
        metrics: dict[str, float] = {}
        with timer("step"):
            with timer("gen"), self.rollout_awake():  # k >= 1: waits for a batch generated during earlier steps
                records, batch = self.rollouts.take(step)
            metrics.update(staleness_metrics(step, batch.policy_version) if batch.token_version is None
                           else token_staleness_metrics(step, batch.token_version, batch.response_mask))
            if batch.episodes is not None:
                metrics.update(multi_turn_metrics(batch))
            with timer("reward"):
                batch = self.score(records, batch, metrics)  # the first draw's reward/*: unbiased by filtering
            if a.filter_groups:  # DAPO's dynamic sampling (run/filtering.py)
                with timer("filter"):
                    (records, batch), filtered = self.filter_groups(step, records, batch)
                    metrics.update(filtered)
            with timer("old_logprob"):
                if a.recompute_old_logprobs:
                    old, entropy = self.actor.run_split(ActorEngine.compute_logprobs_and_entropy, batch)
                    metrics["actor/entropy"] = masked_mean(entropy, batch.response_mask).item()
                    metrics.update(logprob_gap_metrics(batch.sample_logprobs, old, batch.response_mask))
                else:
                    old = batch.sample_logprobs
                batch = batch.with_fields(old_logprobs=old)
            if a.recompute_old_logprobs:
                weights, stats = rollout_weights(batch.old_logprobs, batch.sample_logprobs, batch.response_mask,
                                                 a.rollout_correction, a.rollout_correction_cap,
                                                 a.rollout_correction_low, a.rollout_correction_high)
                batch = batch.with_fields(rollout_weights=weights)
                metrics.update({f"rollout_corr/{k}": v.item() for k, v in stats.items()})
            if self.uses_reference:
                with timer("ref"):
                    ref = self.actor.run_split(ActorEngine.compute_ref_logprobs, batch)
                    batch = batch.with_fields(ref_logprobs=ref)
            if self.critic is not None:  # a critic-free algorithm.adv_estimator builds none
                with timer("values"):
                    if step == 1 and cfg.critic.value_head_init == "regression":  # before the critic's first values
                        mc = advantages.monte_carlo_returns(batch.scores, batch.old_logprobs, batch.ref_logprobs,
                                                            batch.response_mask, cfg.gae, kl_coef=self.reward_kl_coef,
                                                            turn_rewards=batch.turn_rewards)
                        fit = self.critic.run_all(CriticEngine.fit_value_head, batch.with_fields(returns=mc))[0]
                        metrics.update(fit)
                    batch = batch.with_fields(values=self.critic.run_split(CriticEngine.compute_values, batch))
            with timer("adv"):
                batch, adv_metrics = self.compute_advantages(batch, step)
                metrics.update(adv_metrics)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(self.guard_nonfinite("critic", self.critic.run_all(CriticEngine.update, batch)[0]))
            if not self.critic_warmup.active(step):
                with timer("update_actor"):
                    metrics.update(self.guard_nonfinite("actor", self.actor.run_all(ActorEngine.update, batch)[0]))
                with timer("sync"):  # k >= 1: waits for the generation ahead (partial rollouts: pauses it)
                    metrics["perf/sync_bytes"] = float(self.sync_rollout_weights())
            elif cfg.sampler.partial_rollouts:  # the unchanged weights are the policy after this step too
                self.rollout.run_all(PartialSampler.set_policy_version, step)
            self.rollouts.push_done(step)  # in a critic warm-up the rollout's weights are already this step's
            self.critic_warmup.observe(step, deciding_explained_var(metrics))  # critic-free: no warm-up
        metrics.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
        metrics.update(self.perf_metrics(batch, timer.seconds["step"]))
        return metrics, self.samples(batch)

    def score(self, records: list[PromptRecord], batch: Batch, metrics: dict[str, float]) -> Batch:
        """The rollout with its shaped scores ([B] float32: the scorer's, less the shaping penalties); adds
        reward/* to `metrics`."""
        cfg = self.cfg
        scores = self.scorer.score(reward_inputs(records, cfg.sampler.n, batch.response_text))
        metrics.update(reward_metrics(scores, cfg.reward))
        shaped = torch.tensor(scores.values, dtype=torch.float64)  # training only: validation is unshaped
        for name, penalty in shaping.penalties(batch.truncated, batch.row_extents()[1], response_budget(cfg.sampler),
                                               cfg.reward).items():
            shaped = shaped - penalty
            metrics[f"reward/{name}"] = penalty.mean().item()
        return batch.with_fields(scores=shaped.float())

    def filter_groups(self, step: int, records: list[PromptRecord], batch: Batch) -> tuple[Draw, dict[str, float]]:
        """`fill_groups` on the step's scored rollout, extra draws generated and scored here."""
        a, n = self.cfg.algorithm, self.cfg.sampler.n

        def draw(index: int) -> Draw:
            with self.rollout_awake():
                extra = self.rollouts.draw(step, index)
            return extra[0], self.score(*extra, {})  # extra draws' reward/* are not logged

        measure = ((lambda b: b.scores.double()) if a.filter_groups_metric == "score"
                   else (lambda b: (b.scores >= self.cfg.reward.correct_score).double()))
        return fill_groups((records, batch), draw, measure, n=n, prompts=len(records), max_draws=a.filter_groups_max_draws)

    def guard_nonfinite(self, role: str, metrics: dict[str, float]) -> dict[str, float]:
        """`count_nonfinite` of an update's skipped optimizer steps; returns its metrics."""
        self.count_nonfinite(role, int(metrics.get(f"{role}/skipped_steps", 0)), "optimizer step(s) skipped: "
                             "non-finite loss or gradient norm")
        return metrics

    def count_nonfinite(self, role: str, skipped: int, what: str) -> None:
        """Count the PPO steps in a row in which `role` ("actor", "critic", "kl_ctrl") skipped work for a
        non-finite value; stop after trainer.max_skipped_steps of them, before anything is saved."""
        if not skipped:
            self.nonfinite_streak[role] = 0
            return
        self.nonfinite_streak[role] = self.nonfinite_streak.get(role, 0) + 1
        log.warning("%s: step %d: %s", role, self.step, what if role == "kl_ctrl" else f"{skipped} {what}")
        limit = self.cfg.trainer.max_skipped_steps
        if self.nonfinite_streak[role] >= limit:
            raise NonFiniteError(
                f"{role}: non-finite updates in {limit} PPO steps in a row (trainer.max_skipped_steps={limit}); "
                f"lower the learning rate or check the rewards and the data; {self.last_checkpoint_line()}"
            )

    def compute_advantages(self, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """The batch with advantages and returns (`core.advantages.compute`); steps the KL controller."""
        require_finite_scores(batch.scores.tolist())
        kl_coef = self.reward_kl_coef
        out = advantages.compute(batch.scores, batch.old_logprobs, batch.ref_logprobs, batch.values,
                                 batch.response_mask, self.cfg.gae, self.cfg.algorithm, kl_coef=kl_coef,
                                 group_size=self.cfg.sampler.n, warming_up=self.critic_warmup.active(step),
                                 warmup_phase=self.critic_warmup.metric_phase(step), turn_rewards=batch.turn_rewards)
        metrics = {**out.metrics, "response_length/mean": batch.response_mask.sum(dim=1).float().mean().item(),
                   "response_length/clip_ratio": batch.truncated.float().mean().item()}
        if isinstance(self.kl_ctrl, AdaptiveKL):  # a non-finite KL is ignored, counted like a skipped update
            skipped = 0 if self.kl_ctrl.update(out.sequence_kl, len(batch)) else 1
            metrics["kl_ctrl/skipped_updates"] = float(skipped)
            self.count_nonfinite("kl_ctrl", skipped, f"the KL ({out.sequence_kl}) is not finite; the adaptive "
                                 f"controller ignored it (coefficient stays {self.kl_ctrl.value:g})")
        return batch.with_fields(advantages=out.advantages, returns=out.returns), metrics

    @property
    def reward_kl_coef(self) -> float:
        """The coefficient of the KL penalty in the token rewards: the controller's, 0 without a KL in the reward."""
        return self.kl_ctrl.value if self.kl_in_reward else 0.0

    @contextmanager
    def rollout_awake(self) -> Iterator[None]:
        """The rollout engines awake for the block and asleep after it, also when the block raises (its
        error is the one raised; a failure to sleep then is logged). Not after an interrupt: a second
        signal stops at once. On shared accelerators the trainers first return their cached memory,
        which the waking engine needs (sleep mode is off on CPUs). With sampler.max_staleness >= 1 the
        engines never sleep (refused where they would): a sleep call would wait for the generation ahead."""
        if self.cfg.sampler.max_staleness >= 1:
            yield
            return
        if self.cfg.devices.colocate and self.cfg.devices.accelerator != "cpu":
            for group in (g for g in (self.actor, self.critic) if g is not None):
                group.run_all(Worker.release_memory)
        self.rollout.run_all(Sampler.wake)
        try:
            yield
        except Exception:
            try:
                self.rollout.run_all(Sampler.sleep)
            except Exception as e:  # noqa: BLE001  (a dead worker cannot sleep; the block's error says why)
                log.warning("the rollout engines did not go to sleep after an error: %s", e)
            raise
        self.rollout.run_all(Sampler.sleep)

    def sync_rollout_weights(self) -> int:
        """Stream the actor's current weights (LoRA merged, in the compute dtype) from its rank 0
        straight into every rollout replica, in buckets of sampler.sync_bucket_mb; returns the bytes
        each replica received. With partial rollouts the weights are labelled the policy after this step,
        which the tokens sampled from them record."""
        bucket_bytes = int(self.cfg.sampler.sync_bucket_mb * 2**20)
        sent = self.actor.run_all(Worker.push_weights, self.rollout.receivers(), bucket_bytes)
        if self.cfg.sampler.partial_rollouts:
            self.rollout.run_all(PartialSampler.set_policy_version, self.step)
        self.rollout.run_all(Sampler.finish_weight_sync)
        return sent[0]

    def perf_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        """Tokens per second per device; each role's peak memory this step from its workers
        (`Worker.peak_memory_gb`: the accelerator allocator's, else the process's resident set) and the
        share of the time since the last step's end its workers spent outside any call (mean over replicas)."""
        devices = device_count(self.groups, self.cfg.devices.colocate, self.cfg.sampler.vllm.tensor_parallel_size)
        tokens = batch.attention_mask.sum().item()
        peaks = {role: max(group.run_all(Worker.peak_memory_gb, reset=True)) for role, group in self.groups.items()}
        elapsed, self.perf_clock = time.perf_counter() - self.perf_clock, time.perf_counter()
        idle = {role: 1.0 - min(1.0, sum(busy) / len(busy) / elapsed)
                for role, busy in ((role, group.run_all(Worker.busy_seconds)) for role, group in self.groups.items())}
        return {"perf/throughput": tokens / seconds / devices, "perf/max_memory_allocated_gb": max(peaks.values()),
                **{f"perf/{role}/max_memory_allocated_gb": peak for role, peak in peaks.items()},
                **{f"perf/{role}/idle_share": share for role, share in idle.items()}}

    def samples(self, batch: Batch) -> list[dict[str, Any]]:
        rows = range(min(self.cfg.trainer.log_samples, len(batch)))
        return [{"data_source": batch.data_source[i], "prompt": batch.prompt_text[i],
                 "response": batch.response_text[i], "ground_truth": batch.ground_truth[i],
                 "extra_info": batch.extra_info[i], "score": batch.scores[i].item(),
                 **({} if batch.episodes is None else {"turns": batch.episodes[i]["turns"]})}
                for i in rows]

    def validate(self) -> dict[str, float]:
        """`validation_metrics` of eval.n responses per prompt, greedy or sampled with the seed of
        (trainer.seed, step) (`evaluate_records`, as ppo-eval); the responses go to
        val_generations/step_N.jsonl unless eval.save_generations=false."""
        e, r = self.cfg.eval, self.cfg.reward
        temperature = eval_temperature(e.temperature, e.n, self.cfg.sampler.temperature)
        sampling = {"greedy": True} if temperature is None else {"temperature": temperature}

        def generate(prompts: Batch, seed: int) -> Batch:
            return self.rollout.run_split(Sampler.generate, prompts, e.n, seed=seed, max_new_tokens=e.max_new_tokens,
                                          **sampling)

        output_file = self.output_dir / "val_generations" / f"step_{self.step}.jsonl" if e.save_generations else None
        with self.rollout_awake():
            result = evaluate_records(generate, self.val_records, self.val_scorer, pad_id=self.pad_id, n=e.n,
                                      seed=validation_seed(self.cfg.trainer.seed, self.step), limit=e.limit,
                                      batch_size=e.batch_size, extract=EXTRACTORS[r.mode], output_file=output_file)
        return validation_metrics(result)

    def close(self) -> None:
        """Release the workers. After a stop by a signal a Ray cluster may be going down with the run
        (a scheduler signals Ray's processes too, and asking a dead one to kill each worker blocks
        until Ray gives up on it): Ray is disconnected at once instead."""
        for scorer in {id(s): s for s in (self.scorer, self.val_scorer)}.values():
            scorer.close()
        if self._stop_requested is not None and self.cfg.devices.backend == "ray":
            from ppo_trainer.workers.cluster.backend import disconnect

            disconnect()
            return
        for group in (g for g in (self.rollout, self.critic, self.actor) if g is not None):
            group.shutdown()


def run_training(cfg: DictConfig, command: Sequence[str] = (), start_lines: Sequence[str] = ()) -> Optional[float]:
    """Make the config's paths absolute, hold the output folder (`run_folder.exclusive`), build, fit,
    and release the workers; returns the objective for Hydra sweepers. A finished run is not loaded
    again: its summary is printed (`trainer_state.finished_run`). A RunError leaves naming the last
    complete checkpoint. `command`: the command line as typed (masked), for command.txt;
    `start_lines`: what the console says when a run starts (the CLI's dtypes, reward and notes)."""
    output_dir = run_folder.absolute_output_dir(absolute_paths(cfg))
    with run_folder.exclusive(output_dir):
        finished = trainer_state.finished_run(cfg, output_dir)
        if finished is not None:
            print(finished[0], file=console_stream(), flush=True)
            return finished[1]
        for line in start_lines:
            log.info("%s", line)
        try:
            trainer = Trainer.from_config(cfg, command)
        except RunError as e:
            e.checkpoint = checkpoint.last_checkpoint_line(output_dir)
            raise
        try:
            return trainer.fit()
        except (InputError, RunError) as e:  # the models loaded: say where the run stands
            e.checkpoint = checkpoint.last_checkpoint_line(output_dir)
            raise
        finally:
            trainer.close()
