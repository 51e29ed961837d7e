"""One rank of the 2-process gloo run of test_engine_distributed.py.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    python dist_worker.py MODEL_DIR BATCHES_FILE OUT_DIR
Rank 0 writes its results as torch files into OUT_DIR; the test compares them with the same
routines run in the pytest process (one rank).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

START = time.time()

import torch  # noqa: E402
from engine_cases import SMALL_BUDGET, make_actor, make_critic, one_step  # noqa: E402

from ppo_trainer.engine.microbatch import fill_by_cost, micro_batch_units  # noqa: E402


def log(message: str) -> None:
    print(f"{time.time() - START:7.2f}s {message}", flush=True)


def main(model_dir: str, batches_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    log("imported")
    out = Path(out_dir)
    batches = torch.load(batches_file, weights_only=False)
    batch, second = batches["first"], batches["second"]

    actor = make_actor(model_dir)
    local = batch.select(batch.deal(actor.world_size)[actor.rank])
    costs = micro_batch_units(local, actor.layout)
    planned = fill_by_cost(costs.units, costs.cost, SMALL_BUDGET)  # before ranks even out
    layout = torch.tensor([int(local.response_mask.sum()), len(planned)])
    layouts = [torch.zeros_like(layout) for _ in range(actor.world_size)]
    torch.distributed.all_gather(layouts, layout)

    grads, state, stats = one_step(actor, batch, SMALL_BUDGET)
    logprobs = actor.compute_logprobs(batch)  # every rank scores all rows here
    actor.save_hf(out / "actor_hf")
    if actor.rank == 0:
        torch.save({"grads": grads, "state": state, "stats": stats, "logprobs": logprobs,
                    "layouts": torch.stack(layouts)}, out / "actor_step.pt")

    log("actor step")
    actor.save_state(out / "actor_state")
    continued_metrics = actor.update(second)
    continued = actor.full_state_dict()
    resumed_actor = make_actor(model_dir)
    resumed_actor.load_state(out / "actor_state")
    resumed_metrics = resumed_actor.update(second)
    resumed = resumed_actor.full_state_dict()
    if actor.rank == 0:
        torch.save({"continued": continued, "resumed": resumed, "continued_metrics": continued_metrics,
                    "resumed_metrics": resumed_metrics}, out / "actor_resume.pt")

    log("actor resume")
    critic = make_critic(model_dir)
    critic.update(batch)  # moves the zero head, so the next step's gradients reach the backbone
    grads, state, stats = one_step(critic, second, SMALL_BUDGET)
    if critic.rank == 0:
        torch.save({"grads": grads, "state": state, "stats": stats}, out / "critic_step.pt")
    log("critic step")
    critic = make_critic(model_dir)
    fit = critic.fit_value_head(batches["fit"])
    head = {k: v for k, v in critic.full_state_dict().items() if k.startswith("value_head.")}
    values = critic.compute_values(batch)
    if critic.rank == 0:
        torch.save({"metrics": fit, "head": head, "values": values}, out / "critic_fit.pt")
    log("critic fit")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
