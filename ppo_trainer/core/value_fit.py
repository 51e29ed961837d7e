"""The value head fitted by least squares (``critic.value_head_init=regression``): before the
critic's first values, a ridge regression of step 1's Monte Carlo returns on the backbone's hidden
states (the states the head reads; the backbone stays as loaded). A zero head predicts 0 for every
state and explains none of the returns; a reward model's head was trained for other targets. The
fit gives the first advantages a baseline that already tells prompts apart, at the cost of one
more critic forward, once.

Everything is computed from sufficient statistics, the Gram matrix of Z = [states, 1, returns] per
fold (``fold_statistics``), which ranks sum (every rank then solves the same system) and from which
the ridge strength is chosen by cross-validation over folds of whole prompts (a response's tokens
share its return: a fold split inside a response would leak it).

| symbol | shape      | meaning                                                          |
|--------|------------|------------------------------------------------------------------|
| N      |            | valid response tokens                                            |
| H      |            | the backbone's hidden size                                       |
| stats  | [K, H+2, H+2] | float64 Z^T Z of each of the K = ``FOLDS`` folds              |
"""

from __future__ import annotations

import torch

FOLDS = 4
# Ridge strengths tried, as multiples of each feature's own sum of squared deviations (ridge in
# standardised coordinates: hidden states have a few huge dimensions); 1e6 leaves about the bias
# alone, the mean return, so the choice is never worse in cross-validation than a constant.
RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e6)


def fold_statistics(states: torch.Tensor, returns: torch.Tensor, folds: torch.Tensor) -> torch.Tensor:
    """[FOLDS, H+2, H+2] float64 Z^T Z per fold of Z = [states [N, H], 1, returns [N]], token n in
    fold ``folds[n]`` (in [0, FOLDS)); sums over micro-batches and ranks give the whole step's."""
    z = torch.cat([states.double(), states.new_ones(len(states), 1, dtype=torch.float64),
                   returns.double()[:, None]], dim=1)
    out = z.new_zeros(FOLDS, z.shape[1], z.shape[1])
    for k in range(FOLDS):
        zk = z[folds == k]
        out[k] = zk.T @ zk
    return out


def ridge_solve(stats: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """[H+1] (weights, then bias) minimising sum (x.w + b - y)^2 + sum_j penalty_j w_j^2 over the
    tokens of ``stats`` [H+2, H+2]; ``penalty`` [H]. The bias is not penalised. A minimum-norm
    least-squares solve: constant features (zero penalty, zero variance) get weight 0."""
    h = stats.shape[0] - 2
    gram = stats[: h + 1, : h + 1] + torch.diag(torch.cat([penalty, penalty.new_zeros(1)]))
    return torch.linalg.lstsq(gram, stats[: h + 1, h + 1 :], driver="gelsd").solution[:, 0]


def squared_error(stats: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """[] sum over the tokens of ``stats`` of (x.w + b - y)^2 for ``coef`` [H+1]: y'y - 2 c'Z'y + c'Z'Zc."""
    h = stats.shape[0] - 2
    return stats[h + 1, h + 1] - 2 * coef @ stats[: h + 1, h + 1] + coef @ stats[: h + 1, : h + 1] @ coef


def fit_value_head(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weight [H], bias [], metrics) of the ridge fit on all folds of ``stats``, its strength the
    one of ``RIDGES`` with the least error summed over the folds, each predicted by the fit on the
    others. metrics: ``ridge`` (the multiple chosen) and ``cv_explained_var``, 1 - that error's mean
    over the variance of the returns (0 when the returns are constant): how much of a new prompt's
    returns the fitted head explains, as far as one step can tell."""
    total = stats.sum(dim=0)
    h = total.shape[0] - 2
    count = total[h, h].clamp(min=1)
    mean = total[:h, h] / count
    penalty_unit = (total.diagonal()[:h] - count * mean.square()).clamp(min=0)  # sum of squared deviations
    errors = [sum(squared_error(stats[k], ridge_solve(total - stats[k], r * penalty_unit)) for k in range(FOLDS))
              for r in RIDGES]
    best = min(range(len(RIDGES)), key=lambda i: float(errors[i]))
    coef = ridge_solve(total, RIDGES[best] * penalty_unit)
    variance = total[h + 1, h + 1] / count - (total[h, h + 1] / count).square()
    explained = 1 - errors[best] / count / variance if variance > 1e-12 else torch.zeros(())
    return coef[:h], coef[h], {"ridge": RIDGES[best], "cv_explained_var": float(explained)}
