"""Time the reward phase of one batch on reward.num_workers processes: ROWS rows of a reward that
sleeps SLEEP_MS (a stand-in for a slow verifier), once per worker count; the pool starts before
the clock (a run starts it once, before the models load).

    python scripts/bench_reward.py --rows 64 --sleep-ms 50 --workers 0,1,4
"""

from __future__ import annotations

import argparse
import statistics
import time

from ppo_trainer.config.schema import RewardConfig
from ppo_trainer.rewards.calling import RewardInput
from ppo_trainer.rewards.scoring import build_scorer


def sleepy(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """The benchmark's reward (verl's signature): sleeps extra_info["sleep_s"], scores 1."""
    time.sleep(extra_info["sleep_s"])
    return 1.0


def seconds_per_batch(workers: int, rows: list[RewardInput], repeats: int) -> float:
    """Median seconds to score `rows` on `workers` processes (0: in this process)."""
    scorer = build_scorer(RewardConfig(fn=f"{__file__}:sleepy", num_workers=workers,
                                       timeout_s=60.0 if workers else None))
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            scores = scorer.score(rows)
            times.append(time.perf_counter() - start)
            assert scores.values == [1.0] * len(rows) and scores.errors == 0
    finally:
        scorer.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="responses in the batch")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="milliseconds each reward call sleeps")
    parser.add_argument("--workers", default="0,1,4", help="comma-separated reward.num_workers values")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per worker count (median reported)")
    args = parser.parse_args()

    rows = [RewardInput(f"response {i}", "1", "bench", {"sleep_s": args.sleep_ms / 1000}, "prompt")
            for i in range(args.rows)]
    ideal = args.rows * args.sleep_ms / 1000
    baseline = None
    print(f"{args.rows} rows x {args.sleep_ms:g} ms sleep (serial sum {ideal:.2f} s), median of {args.repeats}")
    for workers in (int(w) for w in args.workers.split(",")):
        seconds = seconds_per_batch(workers, rows, args.repeats)
        baseline = baseline or seconds
        floor = ideal / max(workers, 1)
        print(f"reward.num_workers={workers}: {seconds:.3f} s per batch, {args.rows / seconds:.0f} rows/s, "
              f"{baseline / seconds:.2f}x the first, {seconds - floor:+.3f} s over the floor {floor:.3f} s")


if __name__ == "__main__":
    main()
