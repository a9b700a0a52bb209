"""What a reward function run out of process (GuardedScoreFn, HttpRewardClient) said about a batch: each sample's
score checked, and each failure either the run's one-line RewardFunctionError or, when the run accepts failures, a
score of 0.0 with the reason kept for the caller's metrics."""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shardrl.errors import UserError
from shardrl.usercode.wire import is_finite_number, one_line

OnError = Literal["fail", "zero"]  # a failed sample fails the run / scores 0.0 and is counted
Sample = tuple[str, str, Any, dict[str, Any] | None]  # verl's (data_source, solution_str, ground_truth, extra_info)
SAMPLE_FIELDS = 4  # how many positional arguments a reward function is called with


class RewardFunctionError(UserError, RuntimeError):
    """A reward function failed on a sample (raised, timed out, returned no score) or cannot be loaded: one line
    naming the function (or server) and the sample."""


@dataclass(frozen=True)
class BatchScores:
    scores: list[float | dict[str, Any]]  # per sample: a float, or the function's dict with its "score" as a float
    errors: list[str | None]  # per sample: why it failed (its score is then 0.0), None where it did not


def check_on_error(on_error: str) -> None:
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error must be 'fail' or 'zero', got {on_error!r}")


def collect_scores(who: str, samples: Sequence[Sample], outcomes: Sequence[tuple[Any, str | None]],
                   on_error: OnError) -> BatchScores:
    """The batch's scores from each sample's (value, why the call failed or None), the values checked here;
    `who` ("reward function f.py:score") starts each error. With on_error="fail" the first failed sample, by index,
    is raised."""
    scores: list[float | dict[str, Any]] = []
    errors: list[str | None] = []
    for index, (sample, (value, problem)) in enumerate(zip(samples, outcomes, strict=True)):
        problem = problem or _score_problem(value)
        if problem is None:
            scores.append({**value, "score": float(value["score"])} if isinstance(value, dict) else float(value))
            errors.append(None)
            continue
        message = one_line(f"{who} failed on sample {index} (data_source {sample[0]!r}): {problem}")
        if on_error == "fail":
            raise RewardFunctionError(message)
        scores.append(0.0)
        errors.append(message)
    return BatchScores(scores, errors)


def _score_problem(value: Any) -> str | None:
    """Why `value` (as JSON decoded it) is no score, or None: a score is a finite int or float (no bool), or a dict
    holding one under "score"."""
    if is_finite_number(value) or isinstance(value, dict) and is_finite_number(value.get("score")):
        return None
    if not isinstance(value, dict):
        what = f"{type(value).__name__} {reprlib.repr(value)}"
    elif "score" in value:
        what = f"a dict whose 'score' is {type(value['score']).__name__} {reprlib.repr(value['score'])}"
    else:
        what = f"a dict without 'score' (keys {reprlib.repr(sorted(value))})"
    return f"returned {what}; it must return a finite number or a dict with a numeric 'score'"
