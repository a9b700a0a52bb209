"""Scorer of the default job's built-in task (see `shardrl.data.builtin_task`, which names its data source)."""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response starts with the right digit (spaces ignored), else 0.0."""
    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0
