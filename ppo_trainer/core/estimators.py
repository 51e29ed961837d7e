"""The critic-free advantage estimators of ``algorithm.adv_estimator`` (verl's names and formulas,
``verl/trainer/ppo/core_algos.py``): ``grpo``, ``rloo`` and ``reinforce_plus_plus``. They read only
the token rewards (``core.gae.token_rewards``: the score on a response's last valid token, minus
the KL penalty on every valid token when the KL is in the reward), so no value model is built.
Each owns its normalisation: ``gae.normalize_advantages`` is GAE's alone.

The grouped estimators compare a prompt's samples: the batch's rows are groups of ``group_size``
(sampler.n) adjacent rows, sample j of prompt i at row i * group_size + j, as the rollout returns
them. Any response mask works: a masked position inside a response (a multi-turn observation)
adds nothing to a score and gets advantage 0.

| symbol | shape  | meaning                                                                  |
|--------|--------|--------------------------------------------------------------------------|
| s_i    | [B]    | row i's score: its token rewards summed over its valid tokens             |
| g(i)   |        | row i's group: the rows of its prompt, n = group_size of them             |
| A_it   | [B, T] | advantages: grpo and rloo one number per row on each of its valid tokens |
| G_it   | [B, T] | reinforce_plus_plus's returns: discounted sums of the token rewards       |
"""

from __future__ import annotations

import torch

from ppo_trainer.core.gae import compute_gae
from ppo_trainer.core.masked import masked_whiten

GRPO_EPS = 1e-6  # verl's epsilon: a group of equal scores gets advantages 0 (0 / eps), not 0 / 0


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """s_i [B]: the token rewards of row i summed over its valid tokens (the score, plus the KL
    penalties when they are in the reward)."""
    return torch.where(response_mask.bool(), token_rewards, 0).sum(dim=-1)


def grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] scores as [B / group_size, group_size], one prompt's samples per row."""
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} rows do not split into groups of {group_size} samples of a prompt "
                         "(sampler.n)")
    return scores.view(-1, group_size)


def on_tokens(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] values broadcast over each row's valid tokens, [B, T]; 0 on masked positions."""
    return torch.where(response_mask.bool(), per_row.reshape(-1, 1), 0)


@torch.no_grad()
def grpo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int,
                    norm_by_std: bool = True) -> torch.Tensor:
    """A_i = (s_i - mean_g(i)) / (std_g(i) + GRPO_EPS) on row i's valid tokens, [B, T]; with
    ``norm_by_std=false`` (Dr. GRPO) only s_i - mean_g(i). As verl: std is Bessel-corrected
    (torch.std), and a group of one sample has mean 0 and std 1, so its advantage is its score
    (divided by 1 + eps). Dividing by the std gives a prompt whose samples barely differ as large
    an update as one whose samples differ a lot; Dr. GRPO argues that biases learning towards
    prompts that are almost always solved or almost never.
    """
    scores = grouped(sequence_scores(token_rewards, response_mask), group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(scores), torch.ones_like(scores)
    else:
        mean, std = scores.mean(dim=-1, keepdim=True), scores.std(dim=-1, keepdim=True)
    centred = scores - mean
    return on_tokens(centred / (std + GRPO_EPS) if norm_by_std else centred, response_mask)


@torch.no_grad()
def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = s_i - (the mean of the other n - 1 scores of its group) = (n s_i - sum_g(i) s) / (n - 1)
    on row i's valid tokens, [B, T]. The baseline leaves the sample it is subtracted from out, so
    it does not depend on that sample: the estimate stays unbiased. A group of one sample has no
    baseline (its advantage is its score), as in verl. No std scaling.
    """
    scores = grouped(sequence_scores(token_rewards, response_mask), group_size)
    if group_size > 1:
        scores = (group_size * scores - scores.sum(dim=-1, keepdim=True)) / (group_size - 1)
    return on_tokens(scores, response_mask)


@torch.no_grad()
def reinforce_plus_plus_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: (advantages, returns), both [B, T]. Returns G_t = r_t + gamma * G_next, "next"
    the row's next valid token (GAE with values 0 and lambda 1 is exactly this sum); the
    advantages are the returns whitened over the batch's valid tokens (Bessel-corrected std, as
    verl). verl resets its running sum at every masked position, so a response's tokens before a
    masked span would not see the rewards after it; here a masked span is skipped, as in GAE.
    """
    returns = compute_gae(token_rewards, torch.zeros_like(token_rewards), response_mask, gamma, 1.0)[1]
    return masked_whiten(returns, response_mask), returns
