"""The digit tasks' reward. Only the start of the response counts: a random policy ends its
response (EOS) with probability ~0.01 per token, so an exact match would hide nearly every right
answer to a short string."""


def score(response: str, ground_truth: str) -> float:
    """1.0 if `response` starts with `ground_truth` (both stripped of surrounding space), else 0.0."""
    truth = ground_truth.strip()
    return 1.0 if truth and response.strip().startswith(truth) else 0.0
