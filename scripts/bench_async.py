"""Asynchronous rollouts measured: one workload on the ray backend (each role its own process) with
sampler.max_staleness=0 (lock-step) and 1 (the next batch generated while this one trains), from
the runs' own metrics.jsonl: median step seconds, the phases, the share of the time each role's
workers sat idle (`perf/<role>/idle_share`), samples per hour; and, from the lock-step run's phase
times, the projected step of k=1 where the rollout and the trainers have devices of their own.

Workloads:
- `smollm2`: scripts/bench_step.py's smollm2 preset (16 addition prompts, 32 new tokens each with
  ignore_eos, vLLM, one sample per prompt);
- `recipe`: `+experiment=gsm8k_cpu` as README runs it (16 prompts x 4 samples, up to 64 tokens),
  validation cut to 16 problems per set.

    python scripts/bench_async.py --workload smollm2 --steps 8
    python scripts/bench_async.py --workload recipe --steps 6 --json bench_async.json

`--partial` adds a third run, k=1 with partial rollouts (sampler.partial_rollouts: a push cuts the
generation in flight instead of waiting for it; docs/async.md), with the share of samples cut and
the token-level staleness beside the rest:

    python scripts/bench_async.py --workload smollm2 --steps 8 --partial

The first `--skip` steps (default 2: engines warming up, and k=1's first step waits for two
generations) are left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import PRESETS, addition_prompts, bench_overrides, measure_ceilings  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
TRAINING_PHASES = ("reward", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor")


def workload_overrides(workload: str, folder: Path) -> tuple[list[str], int]:
    """The workload's ppo-train overrides (without the run-specific ones) and its samples per step."""
    if workload == "recipe":
        return ["+experiment=gsm8k_cpu", "eval.limit=16"], 16 * 4
    shape = PRESETS["smollm2"]
    overrides = bench_overrides(None, addition_prompts(folder, shape, 0), shape, "cpu", "auto", folder / "unused")
    return [o for o in overrides if not o.startswith(("trainer.output_dir=", "trainer.total_steps=",
                                                      "trainer.loggers=", "devices="))], shape["prompts"]


def run(overrides: list[str], out: Path) -> list[dict]:
    """One ppo-train run in a subprocess (its own Ray cluster, gone when it ends); its metrics."""
    proc = subprocess.run([sys.executable, "-c", TRAIN, *overrides, f"trainer.output_dir={out}"],
                          capture_output=True, text=True, cwd=out.parent,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"ppo-train {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(metrics: list[dict], skip: int, samples: int) -> dict:
    """Medians over the steps after `skip`: step, the wait for the rollout (gen), training, sync, each
    role's idle share; samples per hour at the median step."""
    steps = [m for m in metrics if m["step"] > skip and "timing_s/step" in m]
    if not steps:
        raise SystemExit(f"no steps after --skip {skip}: run more --steps")

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    roles = sorted({k.split("/")[1] for m in steps for k in m if k.endswith("/idle_share")})
    step = median("timing_s/step")
    return {"steps": len(steps), "step_s": step, "gen_s": median("timing_s/gen"),
            "train_s": statistics.median(sum(m.get(f"timing_s/{p}", 0.0) for p in TRAINING_PHASES) for m in steps),
            "sync_s": median("timing_s/sync"), "idle_share": {r: median(f"perf/{r}/idle_share") for r in roles},
            "staleness_max": max(m["rollout/staleness/max"] for m in steps),
            "staleness_mean": median("rollout/staleness/mean"),
            "cut_share": median("rollout/staleness/cut_share"),
            "samples_per_hour": samples / step * 3600}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["smollm2", "recipe"], default="smollm2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--partial", action="store_true", help="also k=1 with sampler.partial_rollouts=true")
    args = parser.parse_args()
    arms = {"0": ["sampler.max_staleness=0"], "1": ["sampler.max_staleness=1"]}
    if args.partial:
        arms["1 partial"] = ["sampler.max_staleness=1", "sampler.partial_rollouts=true"]

    fp32 = measure_ceilings("cpu", torch.float32).tflops * 1e3
    bf16 = measure_ceilings("cpu", torch.bfloat16).tflops * 1e3
    print(f"matmul 2048^2 on this CPU: float32 {fp32:.0f} GFLOP/s, bfloat16 {bf16:.0f} GFLOP/s", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        common, samples = workload_overrides(args.workload, Path(tmp))
        for arm, settings in arms.items():
            overrides = [*common, "devices.backend=ray", "devices.accelerator=cpu", *settings,
                         f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.save_every=0",
                         "trainer.loggers=[jsonl]"]
            print(f"k={arm}: {args.steps} steps ...", flush=True)
            results[arm] = summarize(run(overrides, Path(tmp) / f"k{arm.replace(' ', '_')}"), args.skip, samples)

    lock = results["0"]
    other = lock["step_s"] - lock["gen_s"] - lock["train_s"] - lock["sync_s"]  # bookkeeping between phases
    projected = max(lock["gen_s"], lock["train_s"]) + lock["sync_s"] + other
    print(f"\n{args.workload} on the ray backend, {samples} samples a step, medians of {lock['steps']} steps")
    roles = sorted(lock["idle_share"])
    print("| k | step s | gen wait s | training s | sync s | " + " | ".join(f"{r} idle" for r in roles)
          + " | samples/h | staleness max | staleness mean | cut share |")
    print("|---" * (9 + len(roles)) + "|")
    for arm, r in results.items():
        print(f"| {arm} | {r['step_s']:.1f} | {r['gen_s']:.1f} | {r['train_s']:.1f} | {r['sync_s']:.1f} | "
              + " | ".join(f"{r['idle_share'].get(role, float('nan')):.2f}" for role in roles)
              + f" | {r['samples_per_hour']:.0f} | {r['staleness_max']:.0f} | {r['staleness_mean']:.2f} | "
              f"{r['cut_share']:.2f} |")
    if args.partial:
        gain = results["1"]["step_s"] / results["1 partial"]["step_s"]
        print(f"\nk=1 with partial rollouts against k=1: {gain:.2f}x samples per hour here")
    print(f"\nk=1 against k=0: {lock['step_s'] / results['1']['step_s']:.2f}x samples per hour here (one CPU "
          f"shared by every role). Projection, rollout and trainers on devices of their own: step "
          f"max(gen {lock['gen_s']:.1f}, training {lock['train_s']:.1f}) + sync {lock['sync_s']:.1f} + other "
          f"{other:.1f} = {projected:.1f} s, {lock['step_s'] / projected:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"workload": args.workload, "matmul_gflops": {"float32": fp32, "bfloat16": bf16},
                                         "results": results, "projected_k1_step_s": projected}, indent=1) + "\n")


if __name__ == "__main__":
    main()
