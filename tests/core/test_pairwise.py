"""The Bradley-Terry loss and the pairwise statistics against hand-computed values and a float64 reference."""

from __future__ import annotations

import math

import torch

from ppo_trainer.core.pairwise import bradley_terry_loss, pairwise_metrics, pairwise_sums, score_statistics


def test_the_loss_is_the_mean_of_minus_log_sigmoid_of_the_score_difference():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147
    assert math.isclose(float(bradley_terry_loss(chosen, rejected)), (0.126928 + 0.693147) / 2, abs_tol=1e-6)


def test_a_margin_is_subtracted_from_the_difference_before_the_sigmoid():
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert math.isclose(float(loss), (math.log1p(math.exp(-1.0)) + math.log(2)) / 2, abs_tol=1e-6)


def test_a_micro_batch_share_divides_by_the_mini_batch_pairs_so_shares_sum_to_the_whole():
    c, r = torch.tensor([1.0, -0.5, 3.0, 0.2]), torch.tensor([0.0, 0.5, -1.0, 0.2])
    shares = bradley_terry_loss(c[:1], r[:1], denominator=4) + bradley_terry_loss(c[1:], r[1:], denominator=4)
    assert math.isclose(float(shares), float(bradley_terry_loss(c, r)), rel_tol=1e-6)


def test_bfloat16_scores_give_the_float64_reference_loss_of_the_same_values():
    c = torch.tensor([0.5, -40.0, 30.0, 1.25], dtype=torch.bfloat16)
    r = torch.tensor([0.25, 40.0, -30.0, 1.25], dtype=torch.bfloat16)
    reference = sum(-math.log(1 / (1 + math.exp(-(a - b)))) if a - b > -30 else (b - a)
                    for a, b in zip(c.double().tolist(), r.double().tolist())) / 4
    loss = bradley_terry_loss(c, r)
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))  # no log(0) when r_c << r_r
    assert math.isclose(float(loss), reference, rel_tol=1e-5)


def test_accuracy_counts_only_pairs_the_chosen_wins_a_tie_is_wrong():
    metrics = pairwise_metrics(torch.tensor([2.0, 0.0, 1.0, -1.0]), torch.tensor([0.0, 0.0, 3.0, -2.0]))
    assert metrics["val/pairwise_accuracy"] == 0.5
    assert metrics["val/margin/mean"] == (2 + 0 - 2 + 1) / 4
    assert metrics["val/chosen_score/mean"] == 0.5 and metrics["val/rejected_score/mean"] == 0.25
    # the 8 scores: mean 3/8, mean square 19/8
    assert math.isclose(metrics["val/score/std"], math.sqrt(19 / 8 - (3 / 8) ** 2), rel_tol=1e-12)


def test_sums_and_statistics_are_exact_sums_over_pairs():
    sums = pairwise_sums(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 3.0]))
    assert {k: float(v) for k, v in sums.items()} == {"correct": 1.0, "margin": 0.0, "chosen": 3.0, "rejected": 3.0}
    assert score_statistics(torch.tensor([1.0, 3.0])) == {"mean": 2.0, "std": 1.0, "count": 2}
