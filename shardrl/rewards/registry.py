"""Which built-in scorer handles which `data_source` (a user's reward function runs guarded: `rewards.guarded`).

Every scorer the trainer calls has verl's custom-reward signature:

    fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> float | dict

A dict result must hold the score under "score"; its other entries are reported as per-sample extras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardrl.data.builtin_task import DATA_SOURCE as BUILTIN_TASK
from shardrl.data.builtin_task import LOOKUP_SOURCE as BUILTIN_LOOKUP_TASK
from shardrl.errors import UserError
from shardrl.rewards import digits, gsm8k

ScoreFn = Callable[..., "float | dict[str, Any]"]

# data_source -> fn(solution_str, ground_truth) -> float
_RULE_SCORERS: dict[str, Callable[[str, Any], float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    BUILTIN_TASK: digits.compute_score,
    BUILTIN_LOOKUP_TASK: digits.compute_lookup_score,
}


class UnknownDataSourceError(UserError, LookupError):
    """Data whose `data_source` no built-in scorer handles (and no reward function of the user's scores)."""


def has_scorer(data_source: str) -> bool:
    return data_source in _RULE_SCORERS


def builtin_sources() -> list[str]:
    """The data sources the built-in scorers handle."""
    return sorted(_RULE_SCORERS)


def get_scorer(data_source: str) -> Callable[[str, Any], float]:
    """The built-in `fn(solution_str, ground_truth) -> float` for `data_source`."""
    if data_source not in _RULE_SCORERS:
        raise UnknownDataSourceError(
            f"data_source {data_source!r}: no reward function for it; built-in: {builtin_sources()}; "
            f"set custom_reward_function.path/name for other data"
        )
    return _RULE_SCORERS[data_source]


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float:
    """Score with the built-in scorer registered for `data_source` (the ScoreFn used without a custom function)."""
    return get_scorer(data_source)(solution_str, ground_truth)
