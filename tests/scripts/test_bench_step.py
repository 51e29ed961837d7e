"""scripts/bench_step.py: the rollout-shaped batch of the plain reference, and a --tiny --plain run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_step.py"


def test_rollout_shaped_batch_left_pads_prompts_and_fills_every_response(load_script) -> None:
    bench = load_script("bench_step")
    records = [SimpleNamespace(prompt_ids=[5, 6, 7]), SimpleNamespace(prompt_ids=[8])]
    batch = bench.rollout_shaped_batch(records, pad_id=0, response_len=4, vocab_size=50, seed=0)
    assert batch.input_ids.shape == (2, 3 + 4)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.input_ids[:, :3].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.response_mask.tolist() == [[1] * 4] * 2
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    assert int(batch.input_ids[:, 3:].max()) < 50


def test_tiny_plain_run_reports_every_phase_and_the_plain_reference(tmp_path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--plain", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # the tiny preset recomputes the old logprobs and uses the reference: every phase has a floor
    assert set(result["floor_seconds"]) == {"gen", "old_logprob", "ref", "values", "update_critic", "update_actor", "step"}
    assert set(result["plain_seconds"]) == {"old_logprob", "ref", "values", "update_critic", "update_actor"}
    assert all(s > 0 for s in result["plain_seconds"].values())
    # a forward with its backward costs more than the forward alone
    assert result["plain_seconds"]["update_actor"] > result["plain_seconds"]["old_logprob"]
    assert "x plain" in run.stdout


@pytest.mark.slow
def test_bench_sync_compares_the_two_paths_on_the_tiny_model():
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_sync.py"
    out = subprocess.run([sys.executable, str(script), "--models", "tiny", "--replicas", "1", "--lora", "no",
                          "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("tiny"))
    streamed_driver_mb = float(row.split("|")[2].split()[1])
    assert streamed_driver_mb == 0.0
