"""scripts/bench_memory.py: a smoke run's phases each get a row; a config error keeps ppo-train's exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_memory.py"


def bench_memory(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_every_phase_of_a_smoke_step_gets_a_memory_row(tmp_path: Path) -> None:
    run = bench_memory("--out", "table.txt", "+experiment=smoke", "trainer.total_steps=1",
                       f"trainer.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in (tmp_path / "table.txt").read_text().splitlines()[1:-1]]
    spans = [(int(row[0]), row[1]) for row in rows]
    assert spans[:2] == [(0, "build"), (0, "validate")]
    assert {(1, phase) for phase in ("gen", "ref", "values", "update_critic", "update_actor", "sync", "step")} <= set(spans)
    for row in rows:
        rss_before, rss_peak, rss_after = map(float, row[3:6])
        assert 0 < rss_before <= rss_peak + 0.01 and rss_after <= rss_peak + 0.01  # GiB, printed to 0.01
    step = next(row for row in rows if row[:2] == ["1", "step"])
    phases = [row for row in rows if row[0] == "1" and row[1] not in ("step", "validate")]
    assert float(step[4]) >= max(float(row[4]) for row in phases) - 0.01  # the step's span holds its phases'
    if step[6] != "-":  # glibc's heap figures
        assert float(step[6]) >= max(float(row[6]) for row in phases) - 0.01
    assert "peak resident set (ru_maxrss)" in run.stdout


def test_a_config_error_exits_2_without_a_table(tmp_path: Path) -> None:
    run = bench_memory("--out", "table.txt", "+experiment=smoke", "trainer.total_stepz=1", cwd=tmp_path)
    assert run.returncode == 2
    assert "trainer.total_steps" in run.stderr + run.stdout
    assert not (tmp_path / "table.txt").exists()
