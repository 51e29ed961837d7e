"""Rule-based scoring of math answers: strict ("#### N") and flexible (the last number in the text).

A number: an optional minus sign and "$", digits (commas only as thousands separators) and an
optional decimal part: "-$1,250.50" reads as "-1250.50"; "5-3" is a subtraction, not -3.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

ANSWER_MARKER = "####"

_NUMBER = r"(?P<sign>(?<![\w)\]])-)?\$?(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"\s*\$?\s*" + _NUMBER)


def _canonical(match: re.Match[str]) -> str:
    return (match.group("sign") or "") + match.group("digits").replace(",", "")


def extract_strict(text: str) -> Optional[str]:
    """The number right after the last "####" (commas and "$" stripped), or None; only the last
    marker counts: "#### 5 ... #### none" has no strict answer."""
    _, marker, tail = text.rpartition(ANSWER_MARKER)
    if not marker:
        return None
    match = _STRICT_RE.match(tail)
    return _canonical(match) if match else None


def extract_flexible(text: str) -> Optional[str]:
    """The last number anywhere in the text (commas and "$" stripped), or None."""
    matches = list(_NUMBER_RE.finditer(text))
    return _canonical(matches[-1]) if matches else None


EXTRACTORS = {"strict": extract_strict, "flexible": extract_flexible}  # reward.mode -> its answer


def answers_equal(answer: str, ground_truth: str) -> bool:
    """Numeric equality when both parse as finite numbers once spaces, commas and "$" are stripped
    ("3.0" == "3"), else exact match of the stripped text."""
    try:
        a, b = (Decimal(text.strip().replace(",", "").replace("$", "")) for text in (answer, ground_truth))
        if a.is_finite() and b.is_finite():
            return a == b
    except InvalidOperation:
        pass
    return answer.strip() == ground_truth.strip()


def score(response: str, ground_truth: str, *, mode: str = "strict", format_score: float = 0.0,
          correct_score: float = 1.0) -> float:
    """`correct_score` if the answer of `mode` (`EXTRACTORS`) equals `ground_truth`, `format_score`
    if it differs, 0.0 if there is none."""
    if mode not in EXTRACTORS:
        raise ValueError(f"reward mode {mode!r} is unknown; use 'strict' or 'flexible'")
    answer = EXTRACTORS[mode](response)
    if answer is None:
        return 0.0
    return correct_score if answers_equal(answer, ground_truth) else format_score
