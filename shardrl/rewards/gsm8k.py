"""Rule-based GSM8K scorer.

Extraction reads one token:
- strict: the token right after the last `####` (the format the prompt asks for; spaces between are allowed);
- flexible: the last token anywhere.
Only the last `TAIL_CHARS` characters of the output are searched: the answer is asked for at the end, and long
degenerate outputs would otherwise cost regex time and reward a number that happened to appear early.

A token is the longest run that could be meant as one number: any signs (`-`, `+`, the Unicode minus U+2212) and `$`,
then digits or a dot and a digit (`.5`; not after another dot, so `...5` is 5), then digits, dots, commas and
exponents (`e3`, `E-3`). Trailing dots and commas are sentence punctuation and dropped ("72." is 72, "3, 4" is 3 then
4); signs are only read at the start, so "5-3" is 5 then -3, as before.

A token is a number when it is, in full: any `$`, at most one sign, any `$` (`-$5`, `$-5`, `$$5$$`), then an integer
part of digits or of 1-3 digits and comma-separated groups of 3 (`1,234`; `1,23` is not a number), an optional decimal
part `.digits`, or only a decimal part (`.5`), and an optional exponent `e`/`E`, an optional sign, digits (`1e3`).
Every other token is a string, kept as written: `--5`, `1.2.3`, `1,23`. `--5` is not read as -5 or 5 nor skipped: it
compares equal only to a ground truth that is literally `--5` (none in GSM8K), so it can never score as correct by
accident. Treating it as "no number here" would make a scanner resume inside the run (`-5`) or, in flexible mode,
fall back to an earlier number, which can match the ground truth. Like any wrong answer it earns `format_score`.

Comparison: when both the answer and the ground truth are numbers, numerically, exactly and in decimal: "18", "18.0",
"18.00" and "1.8e1" all equal "18" (verl compares the strings, so "18.0" would score 0 against "18"). Numbers are parsed
with `Decimal`, never floats, so "0.1" vs "0.10" is exact and large integers do not round. Otherwise both are compared
as strings: the ground truth with surrounding whitespace and trailing dots and commas removed, exactly as the token
(so "1.2.3" matches "1.2.3", and a number never matches a string).

Scores: `score` for a correct answer, `format_score` for an answer that was found but is wrong, 0 when no token
could be extracted.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Literal

TAIL_CHARS = 300
_SIGN = "[-+\u2212]"
_TOKEN = rf"[-+\u2212$]*(?:(?<![.\d])\.)?\d(?:[\d.,]|[eE]{_SIGN}?\d)*"
_STRICT = re.compile(r"####\s*(" + _TOKEN + ")")
_FLEXIBLE = re.compile(_TOKEN)
_NUMBER = re.compile(
    rf"\$*(?P<sign>{_SIGN})?\$*"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    rf"(?P<exponent>[eE]{_SIGN}?\d+)?"
)


def _clean(text: str) -> str:
    """Drop surrounding whitespace and sentence punctuation: ' 72. ' -> '72'."""
    return text.strip().rstrip(".,")


def _to_decimal(token: str) -> Decimal | None:
    """'$-1,234.50' -> Decimal('-1234.50'), '−.5' -> Decimal('-0.5'); None when the token is not a number."""
    match = _NUMBER.fullmatch(token)
    if match is None:
        return None
    text = (match["sign"] or "") + match["digits"].replace(",", "") + (match["exponent"] or "")
    return Decimal(text.replace("\u2212", "-"))


def _extract(solution_str: str, method: str) -> tuple[str, Decimal | None] | None:
    """(token, its value or None for a string token) of the answer in the tail, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-TAIL_CHARS:]
    matches = _STRICT.findall(tail) if method == "strict" else _FLEXIBLE.findall(tail)
    if not matches:
        return None
    token = _clean(matches[-1])
    return token, _to_decimal(token)


def extract_answer(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer in the tail of `solution_str`, or None: a number as `str(Decimal)` ('$1,234.50' -> '1234.50',
    '1e3' -> '1E+3'), a token that is not a number as written ('--5', '1.2.3')."""
    found = _extract(solution_str, method)
    if found is None:
        return None
    token, value = found
    return token if value is None else str(value)


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if one was found but differs, else 0."""
    found = _extract(solution_str, method)
    if found is None:
        return 0.0
    token, value = found
    expected_token = _clean(str(ground_truth))
    expected = _to_decimal(expected_token)
    if value is not None and expected is not None:
        correct = value == expected
    else:
        correct = token == expected_token
    return score if correct else format_score
