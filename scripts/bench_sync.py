"""Weight sync on the Ray CPU backend, through the driver against streamed.

    python scripts/bench_sync.py                                  # tiny and SmolLM2, full and LoRA, 1 and 2 replicas
    python scripts/bench_sync.py --models smollm2 --replicas 2 --repeats 3

"through the driver" is the sync of earlier versions: the actor's gathered float32 state (LoRA
merged) is returned to the driver, which sends it to every rollout replica. "streamed" is
`Trainer.sync_rollout_weights`: the actor's rank 0 puts buckets of sampler.sync_bucket_mb in Ray's
object store and the replicas fetch them. Each case runs in a fresh subprocess with its own local
Ray and reports: the median sync seconds over --repeats, the bytes the driver received, and the
peak resident memory (ru_maxrss, monotone) of the driver and of the largest rollout replica after
the builds, after the streamed syncs and after the syncs through the driver (in that order).
Print the machine's matmul rate beside the times (scripts/bench_step.py prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODELS = {"tiny": ["+experiment=smoke", "sampler=vllm", "sampler.vllm.kv_cache_gb=0.05"],
          "smollm2": ["+experiment=gsm8k_cpu"]}


def driver_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_case(model: str, lora: bool, replicas: int, repeats: int) -> dict:
    from ppo_trainer.config.composition import compose
    from ppo_trainer.engine.actor import ActorEngine
    from ppo_trainer.rollout import Sampler
    from ppo_trainer.workers.group import build_groups
    from ppo_trainer.workers.roles import Worker

    lora_keys = ["model.lora.rank=32", "model.lora.alpha=64"] if lora else ["model.lora.rank=0"]
    cfg = compose([*MODELS[model], *lora_keys, "devices.backend=ray", "devices.accelerator=cpu",
                   f"devices.rollout.num_devices={replicas}", "trainer.output_dir=/tmp/bench_sync"])
    groups = build_groups(cfg)
    actor, rollout = groups["actor"], groups["rollout"]

    def peaks() -> dict:
        return {"driver_gb": round(driver_peak_gb(), 3),
                "replica_gb": round(max(rollout.run_all(Worker.peak_memory_gb)), 3)}

    result = {"model": model, "lora": lora, "replicas": replicas, "after_build": peaks()}
    bucket = int(cfg.sampler.sync_bucket_mb * 2**20)
    seconds, sent = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        sent = actor.run_all(Worker.push_weights, rollout.receivers(), bucket)[0]
        rollout.run_all(Sampler.finish_weight_sync)
        seconds.append(time.perf_counter() - start)
    result["streamed"] = {"seconds": round(statistics.median(seconds), 3), "driver_bytes": 0,
                          "bytes_per_replica": sent, **peaks()}
    seconds, received = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        state = actor.run_all(ActorEngine.full_state_dict)[0]
        rollout.run_all(Sampler.sync_weights, state)
        seconds.append(time.perf_counter() - start)
        received = sum(t.numel() * t.element_size() for t in state.values())
        del state
    result["through_driver"] = {"seconds": round(statistics.median(seconds), 3), "driver_bytes": received, **peaks()}
    for group in groups.values():
        group.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--lora", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the subprocess
    args = parser.parse_args()
    if args.case:
        model, lora, replicas = args.case.split(",")
        print("RESULT " + json.dumps(run_case(model, lora == "yes", int(replicas), args.repeats)), flush=True)
        return
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    print(f"{'model':8} {'lora':4} {'rep':3} | {'through the driver':^42} | {'streamed':^42}")
    print(f"{'':8} {'':4} {'':3} | {'s':>6} {'driver MB':>10} {'driver GiB':>11} {'replica GiB':>11} "
          f"| {'s':>6} {'driver MB':>10} {'driver GiB':>11} {'replica GiB':>11}")
    for model in args.models:
        for lora in args.lora:
            for replicas in args.replicas:
                out = subprocess.run([sys.executable, __file__, "--case", f"{model},{lora},{replicas}",
                                      "--repeats", str(args.repeats)], capture_output=True, text=True, env=env)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"{model} lora={lora} replicas={replicas}: failed\n{out.stderr[-2000:]}")
                    continue
                r = json.loads(line[len("RESULT ") :])
                cells = []
                for key in ("through_driver", "streamed"):
                    c = r[key]
                    cells.append(f"{c['seconds']:6.2f} {c['driver_bytes'] / 1e6:10.1f} {c['driver_gb']:11.2f} "
                                 f"{c['replica_gb']:11.2f}")
                print(f"{model:8} {lora:4} {replicas:3} | {cells[0]} | {cells[1]}   (after build: driver "
                      f"{r['after_build']['driver_gb']:.2f} GiB, replica {r['after_build']['replica_gb']:.2f} GiB)")


if __name__ == "__main__":
    main()
