"""Time the driver-side PPO math (GAE, whitening, policy and value loss) on CPU.

    python scripts/bench_core.py --batch 1024 --length 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ppo_trainer.core.gae import compute_gae
from ppo_trainer.core.losses import policy_loss, value_loss
from ppo_trainer.core.masked import masked_whiten


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations are not what we measure
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024, help="sequences B")
    parser.add_argument("--length", type=int, default=1024, help="response tokens T")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per part (median reported)")
    args = parser.parse_args()

    torch.manual_seed(0)
    batch, length = args.batch, args.length
    lengths = torch.randint(1, length + 1, (batch,))
    mask = (torch.arange(length) < lengths[:, None]).float()
    rewards, values, old_values, old_logprobs = torch.randn(4, batch, length).unbind(0)
    advantages, returns = compute_gae(rewards, values, mask, 0.99, 0.95)
    logprobs = (old_logprobs + 0.1 * torch.randn(batch, length)).requires_grad_(True)
    new_values = (values + 0.1 * torch.randn(batch, length)).requires_grad_(True)

    def policy_step() -> None:
        policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, dual_clip=3.0).loss.backward()

    def value_step() -> None:
        value_loss(new_values, old_values, returns, mask, clip=0.5).loss.backward()

    parts = {
        "gae": median_ms(lambda: compute_gae(rewards, values, mask, 0.99, 0.95), args.repeats),
        "whiten": median_ms(lambda: masked_whiten(advantages, mask), args.repeats),
        "policy_loss(fwd+bwd)": median_ms(policy_step, args.repeats),
        "value_loss(fwd+bwd)": median_ms(value_step, args.repeats),
    }
    cells = " | ".join(f"{name} {ms:.1f} ms" for name, ms in parts.items())
    print(
        f"B={batch} T={length} threads={torch.get_num_threads()} | {cells} | total {sum(parts.values()):.1f} ms"
        f" (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
