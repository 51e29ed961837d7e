#!/usr/bin/env bash
# Kill a CPU smoke run with SIGKILL at 5 random moments, rerun the same command after each kill,
# then compare its final metrics.jsonl with an uninterrupted run's (all keys but timing_s/*, perf/*).
#   bash scripts/chaos_resume.sh            (SEED=N for other kill moments; KILLS=N for more kills)
set -euo pipefail
work=$(mktemp -d /tmp/chaos_resume.XXXXXX)
seed=${SEED:-0}
kills=${KILLS:-5}
RANDOM=$seed
common=(+experiment=smoke trainer.total_steps=6 trainer.save_every=1 "trainer.loggers=[jsonl]")
cd "$work"

echo "uninterrupted run..."
start=$(date +%s)
ppo-train "${common[@]}" trainer.output_dir="$work/reference" > reference.log 2>&1
total=$(( $(date +%s) - start ))
echo "uninterrupted run took ${total}s; each kill lands at a random moment between a third of that and all of it"

for i in $(seq 1 "$kills"); do
  delay=$(( total / 3 + RANDOM % (total - total / 3 + 1) ))
  setsid ppo-train "${common[@]}" trainer.output_dir="$work/chaos" > "chaos_$i.log" 2>&1 &
  pid=$!
  sleep "$delay"
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "kill $i: SIGKILL after ${delay}s; latest checkpoint: $(cat "$work/chaos/checkpoints/latest" 2>/dev/null || echo none)"
  else
    wait "$pid" || true
    echo "kill $i: the run had already finished after ${delay}s"
  fi
done
echo "final rerun of the same command..."
ppo-train "${common[@]}" trainer.output_dir="$work/chaos" > final.log 2>&1

python - "$work/reference/metrics.jsonl" "$work/chaos/metrics.jsonl" <<'PY'
import json, sys
def load(path):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
            for r in map(json.loads, open(path).read().splitlines())}
ref, chaos = load(sys.argv[1]), load(sys.argv[2])
diffs = [(s, k) for s in ref for k in ref[s] if chaos.get(s, {}).get(k) != ref[s][k]]
missing = sorted(set(ref) ^ set(chaos))
print(f"steps compared: {sorted(ref)}; keys per step: {len(ref[max(ref)])}")
if diffs or missing:
    print(f"MISMATCH: steps missing {missing}, differing {diffs[:10]}")
    sys.exit(1)
print("all equal: the killed-and-resumed run's metrics match the uninterrupted run's")
PY
echo "logs and runs in $work"
