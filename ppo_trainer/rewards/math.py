"""Rule-based scoring of math answers: strict ("#### N") and flexible (the last number in the text).

A number: an optional minus sign and "$", digits (commas only as thousands separators) and an
optional decimal part: "-$1,250.50" reads as "-1250.50"; "5-3" is a subtraction, not -3.

A ground truth is taken as the data gives it (`truth_answers`): a GSM8K solution ("... #### 1,600")
counts for the text after its last "####", a bare string or number as it is, a list for each of
its elements.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional

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


def truth_answers(ground_truth: Any) -> list[str]:
    """The answers a ground truth accepts. A string: the text after its last "####" (all of it
    without one), stripped, a number in it without thousands separators ("1,600" -> "1600"; "(1, 2)"
    stays); an int or float: as written; a non-empty list of those: each one's. ValueError for
    anything else (None, a bool, an object, a list inside the list) and for a string with nothing
    after its "####". The data loader asks this of every row the math reward will score
    (`rewards.loader.answer_check`), so such a row is refused at load, not after the models load."""
    if not isinstance(ground_truth, list):
        return [_answer(ground_truth, "")]
    if not ground_truth:
        raise ValueError("[] is an empty list: no answer to compare")
    return [_answer(item, " inside a list") for item in ground_truth]


def _answer(value: Any, where: str) -> str:
    """The answer of one string or number (`truth_answers`); ValueError naming `value` and `where` it was."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"the math reward reads a string, a number or a list of them, not {type(value).__name__} "
                         f"{value!r:.60}{where}")
    text = value.rpartition(ANSWER_MARKER)[2].strip()
    if not text:
        raise ValueError(f"ground truth {value!r:.60} has nothing after '{ANSWER_MARKER}'")
    number = _NUMBER_RE.fullmatch(text)
    return _canonical(number) if number else text


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


def score(response: str, ground_truth: Any, *, mode: str = "strict", format_score: float = 0.0,
          correct_score: float = 1.0) -> float:
    """`correct_score` if the answer of `mode` (`EXTRACTORS`) equals one of `truth_answers(ground_truth)`,
    `format_score` if it differs, 0.0 if there is none."""
    if mode not in EXTRACTORS:
        raise ValueError(f"reward mode {mode!r} is unknown; use 'strict' or 'flexible'")
    truths = truth_answers(ground_truth)
    answer = EXTRACTORS[mode](response)
    if answer is None:
        return 0.0
    return correct_score if any(answers_equal(answer, truth) for truth in truths) else format_score
