"""Rule-based GSM8K scorer.

Extraction:
- strict: the number after the last `####` (the format the prompt asks for);
- flexible: the last number anywhere.
Only the last `TAIL_CHARS` characters of the output are searched: the answer is asked for at the end, and long
degenerate outputs would otherwise cost regex time and reward a number that happened to appear early.
`$` and thousands commas are removed; a leading `-` (also as `-$5` or `$-5`) makes the number negative.

Comparison is numeric, exact and decimal: "18", "18.0" and "18.00" all equal "18" (verl compares the strings, so
"18.0" would score 0 against "18"). Numbers are parsed with `Decimal`, never floats, so "0.1" vs "0.10" is exact and
large integers do not round. A ground truth that is not a number is compared as a stripped string.

Scores: `score` for a correct answer, `format_score` for an answer that was found but is wrong, 0 when no answer
could be extracted.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal

TAIL_CHARS = 300
# A number: optional sign/currency prefix, digits with optional thousands commas, optional decimal part. It ends
# on a digit so that "3, 4" yields "3" and a sentence-final "72." yields "72".
_NUMBER = r"[-$]*\d(?:[\d,]*\d)?(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def _to_decimal(text: str) -> Decimal | None:
    """'$-1,234.50' -> Decimal('-1234.50'); None when it is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    negative = cleaned.startswith("-")
    try:
        value = Decimal(cleaned.lstrip("-"))
    except InvalidOperation:
        return None
    return -value if negative else value


def extract_answer(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer string found in the tail of `solution_str` (normalised: no `$` or commas), or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-TAIL_CHARS:]
    matches = _STRICT.findall(tail) if method == "strict" else _FLEXIBLE.findall(tail)
    if not matches:
        return None
    value = _to_decimal(matches[-1])
    return None if value is None else str(value)


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if one was found but differs, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    expected = _to_decimal(str(ground_truth))
    correct = Decimal(answer) == expected if expected is not None else answer == str(ground_truth).strip()
    return score if correct else format_score
