"""GSM8K reward with a small format bonus, for models that do not use the `####` format on their own.

Qwen2.5-Coder-0.5B-Instruct ends its answers with `\\boxed{N}` and SmolLM2-135M-Instruct rarely with `####
<number>`, so the strict scorer gives every sample of a group the same 0 and GRPO has no signal. This scorer keeps
the strict check for the score that matters (1 for a correct answer after `####`) and gives `FORMAT_SCORE` for an
answer in that format that is wrong, so the policy can first learn the format. `acc` (strict correctness, the number
verl's default GSM8K reward reports) and `formatted` are returned as extras: training logs them as
`reward_extra/...`, validation as `val-aux/...`.

    custom_reward_function.path=examples/gsm8k/format_bonus_reward.py custom_reward_function.name=compute_score
"""

from __future__ import annotations

from typing import Any

from shardrl.rewards import gsm8k

FORMAT_SCORE = 0.1


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, float]:
    correct = gsm8k.compute_score(solution_str, ground_truth) == 1.0
    formatted = gsm8k.extract_answer(solution_str, "strict") is not None
    score = 1.0 if correct else FORMAT_SCORE if formatted else 0.0
    return {"score": score, "acc": float(correct), "formatted": float(formatted)}
