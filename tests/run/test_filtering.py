"""`run.filtering.fill_groups` (DAPO's dynamic sampling) with scripted draws, no model: the batch keeps
data.train_batch_size groups, the draws come in the loader's order, the cap fills from the last draw
and counts it; and tiny runs with algorithm.filter_groups on, whose resume equals the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppo_trainer.config.composition import compose
from ppo_trainer.data import PromptRecord
from ppo_trainer.evaluate import prompt_batch
from ppo_trainer.rollout.base import assemble_rollout
from ppo_trainer.run.filtering import fill_groups
from ppo_trainer.trainer import run_training

N, PROMPTS = 2, 4


def scored_draw(draw: int, scores: list[float]):
    """Draw `draw`'s prompts (question "d<draw>.<i>") and rollout: one token per row, the given scores."""
    records = [PromptRecord(index=i, question=f"d{draw}.{i}", prompt=f"d{draw}.{i}", prompt_ids=(5, 6 + i),
                            ground_truth="0", data_source="toy", extra_info={}) for i in range(PROMPTS)]
    rows = PROMPTS * N
    batch = assemble_rollout(prompt_batch(records, 0), N, [[draw + 1]] * rows, [[-1.0]] * rows, [False] * rows,
                             ["x"] * rows, pad_id=0)
    return records, batch.with_fields(scores=torch.tensor(scores))


def run_filter(script: dict[int, list[float]], max_draws: int = 10):
    asked: list[int] = []

    def draw(index: int):
        asked.append(index)
        return scored_draw(index, script[index])

    (records, batch), metrics = fill_groups(scored_draw(0, script[0]), draw, lambda b: b.scores.double(),
                                            n=N, prompts=PROMPTS, max_draws=max_draws)
    assert len(records) == PROMPTS and len(batch) == PROMPTS * N
    for i, record in enumerate(records):  # a kept group's rows stay with their prompt
        draw_of = int(record.question[1:].partition(".")[0])
        assert batch.response_ids[i * N:(i + 1) * N, 0].tolist() == [draw_of + 1] * N
    return [r.question for r in records], batch, metrics, asked


def test_a_draw_with_spread_everywhere_is_kept_whole_without_drawing_more():
    questions, batch, metrics, asked = run_filter({0: [0, 1, 1, 0, 0, 0.5, 2, 3]})
    assert questions == ["d0.0", "d0.1", "d0.2", "d0.3"] and asked == []
    assert metrics == {"filter/kept_groups": 4.0, "filter/draws": 1.0, "filter/filled_groups": 0.0}
    assert batch.scores.tolist() == [0, 1, 1, 0, 0, 0.5, 2, 3]


def test_flat_groups_are_dropped_and_the_next_draws_fill_in_the_loaders_order():
    script = {0: [1, 1, 0, 1, 0, 0, 1, 0],  # groups 1 and 3 have spread
              1: [0, 0, 0, 0, 0, 0, 0, 0],  # none
              2: [0, 0, 1, 0, 0, 1, 1, 0]}  # groups 1, 2, 3: one is needed beyond group 1
    questions, batch, metrics, asked = run_filter(script)
    assert questions == ["d0.1", "d0.3", "d2.1", "d2.2"] and asked == [1, 2]
    assert metrics == {"filter/kept_groups": 4.0, "filter/draws": 3.0, "filter/filled_groups": 0.0}
    assert batch.scores.tolist() == [0, 1, 1, 0, 1, 0, 0, 1]


def test_at_the_cap_the_last_draws_groups_fill_the_rest_and_are_counted():
    script = {0: [1, 0, 0, 0, 0, 0, 0, 0],  # group 0 kept
              1: [0, 0, 0, 0, 0, 0, 0, 0],
              2: [0, 0, 5, 5, 1, 2, 0, 0]}  # the cap: group 2 has spread, groups 0 and 1 fill
    questions, _, metrics, asked = run_filter(script, max_draws=3)
    assert questions == ["d0.0", "d2.0", "d2.1", "d2.2"] and asked == [1, 2]
    assert metrics == {"filter/kept_groups": 2.0, "filter/draws": 3.0, "filter/filled_groups": 2.0}


def test_a_cap_of_one_draw_trains_on_the_steps_own_rollout():
    questions, _, metrics, asked = run_filter({0: [0, 0, 0, 1, 0, 0, 2, 2]}, max_draws=1)
    assert questions == ["d0.0", "d0.1", "d0.2", "d0.3"] and asked == []
    assert metrics == {"filter/kept_groups": 1.0, "filter/draws": 1.0, "filter/filled_groups": 3.0}


SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "data.arithmetic.val_size=2", "trainer.total_steps=4",
         "trainer.save_every=2", "algorithm.filter_groups=true", "algorithm.filter_groups_max_draws=3"]
# the response's length varies with the sample, so some groups of a random model have spread


def read_metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def loader_position(output_dir: Path, step: int) -> int:
    state = json.loads((output_dir / "checkpoints" / f"global_step_{step}" / "state" / "trainer.json").read_text())
    return state["loader"]["parts"][0]["position"]


@pytest.mark.parametrize("metric", ["score", "acc"])
def test_a_flat_reward_fills_at_the_cap_every_step_and_trains(tmp_path, metric):
    run_training(compose([*SMOKE, "trainer.total_steps=2", f"algorithm.filter_groups_metric={metric}",
                          f"trainer.output_dir={tmp_path}"]))
    for step in (1, 2):
        got = read_metrics(tmp_path)[step]  # the smoke reward is 0 for every sample
        assert (got["filter/kept_groups"], got["filter/draws"], got["filter/filled_groups"]) == (0.0, 3.0, 4.0)
    assert loader_position(tmp_path, 2) == 2 * 3 * 4  # steps x draws x prompts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, reward_fn) -> Path:
    out = tmp_path_factory.mktemp("filtered")
    run_training(compose([*SMOKE, reward_fn, f"trainer.output_dir={out}"]))
    return out


def test_a_varying_reward_keeps_groups_with_spread(uninterrupted):
    got = read_metrics(uninterrupted)
    assert sum(got[s]["filter/kept_groups"] for s in range(1, 5)) > 0
    for step in range(1, 5):
        m = got[step]
        assert m["filter/kept_groups"] + m["filter/filled_groups"] == 4
        assert 1 <= m["filter/draws"] <= 3 and (m["filter/filled_groups"] == 0 or m["filter/draws"] == 3)


def test_a_resumed_run_equals_the_uninterrupted_one(uninterrupted, reward_fn, tmp_path, assert_resumed_like):
    run_training(compose([*SMOKE, reward_fn, f"trainer.output_dir={tmp_path}", "trainer.stop_after_steps=2"]))
    run_training(compose([*SMOKE, reward_fn, f"trainer.output_dir={tmp_path}"]))  # the same command resumes
    assert_resumed_like(uninterrupted, tmp_path, (3, 4))
    assert loader_position(tmp_path, 4) == loader_position(uninterrupted, 4)
