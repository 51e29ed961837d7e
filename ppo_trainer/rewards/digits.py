"""The digit tasks' reward. Only the start of the response counts: a random policy ends its
response (EOS) with probability ~0.01 per token, so an exact match would hide nearly every right
answer to a short string."""

from typing import Any


def score(response: str, ground_truth: Any) -> float:
    """1.0 if `response` starts with `ground_truth` (a string, or an int as written; both stripped of
    surrounding space), else 0.0. ValueError for another type."""
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str):
        raise ValueError(f"the digits reward reads a string or an int ground truth, not {type(ground_truth).__name__}")
    truth = ground_truth.strip()
    return 1.0 if truth and response.strip().startswith(truth) else 0.0
