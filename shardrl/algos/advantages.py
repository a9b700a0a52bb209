"""The built-in advantage estimators, with the meaning verl users know under the same names.

Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline, opo) score a response by the sum of its token rewards
over valid tokens (those of `score_mask` when given: the tokens as sampled, before rejection sampling) and give that
one number to every valid token. Group estimators compare a response with the
other samples of the same prompt (`index`, the prompt uid); a prompt with a single sample has no group to compare
with and keeps its raw score (baseline 0, scale 1). Every result is zero at masked positions, and nothing stored at
a masked position (reward, value) affects any valid one.
"""

from collections.abc import Sequence
from typing import TypeVar

import torch

from shardrl.algos.gae import discounted_returns, gae_advantages_returns
from shardrl.algos.masked import masked_sum, masked_whiten
from shardrl.algos.registry import AdvantageInputs, register_adv_estimator

# Added to the group std before dividing: a group whose samples all scored the same gets advantage 0, not NaN.
GRPO_EPS = 1e-6

Value = TypeVar("Value")


def group_ids(index: Sequence | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Dense group numbers `[B]` for a prompt-uid column (strings, ints, a numpy array or a tensor)."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index, return_inverse=True)[1].to(device)
    numbering: dict = {}
    return torch.tensor([numbering.setdefault(key, len(numbering)) for key in index], dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Size, mean and unbiased std of each sample's group, gathered back per sample (each `[B]`)."""
    num_groups = int(ids.max()) + 1
    count = scores.new_zeros(num_groups).index_add_(0, ids, torch.ones_like(scores))  # [G]
    mean = scores.new_zeros(num_groups).index_add_(0, ids, scores) / count  # [G]
    squared_deviation = scores.new_zeros(num_groups).index_add_(0, ids, (scores - mean[ids]) ** 2)  # [G]
    std = (squared_deviation / (count - 1).clamp(min=1)).sqrt()  # [G]
    return count[ids], mean[ids], std[ids]


def _sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """Each response's total reward over its valid tokens `[B]` (`score_mask`'s, when given)."""
    mask = inputs.response_mask if inputs.score_mask is None else inputs.score_mask
    return masked_sum(inputs.token_level_rewards, mask, dim=-1)


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give each valid token its sequence's value: `[B]` -> `[B, T]`, zero at masked positions."""
    return torch.where(response_mask.bool(), per_sequence[:, None], 0.0)


def _require(value: Value | None, field: str, estimator: str) -> Value:
    if value is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs `{field}` in the batch; none was given")
    return value


def _group_ids_for(inputs: AdvantageInputs, estimator: str) -> torch.Tensor:
    index = _require(inputs.index, "index (prompt uid)", estimator)
    return group_ids(index, device=inputs.token_level_rewards.device)


@register_adv_estimator("gae")
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: GAE(gamma, lam) advantages whitened over the batch; returns are the critic's targets."""
    values = _require(inputs.values, "values (critic)", "gae")
    advantages, returns = gae_advantages_returns(
        inputs.token_level_rewards, values, inputs.response_mask, inputs.gamma, inputs.lam
    )
    return masked_whiten(advantages, inputs.response_mask), returns


@register_adv_estimator("grpo")
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(score - group mean), divided by the group std unless `norm_adv_by_std_in_grpo` is off (Dr. GRPO)."""
    scores = _sequence_scores(inputs)  # [B]
    count, mean, std = _group_stats(scores, _group_ids_for(inputs, "grpo"))
    single = count == 1
    centred = scores - torch.where(single, 0.0, mean)
    if inputs.norm_adv_by_std_in_grpo:
        centred = centred / (torch.where(single, 1.0, std) + GRPO_EPS)
    advantages = _broadcast(centred, inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("rloo")
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: score minus the mean of the *other* samples, i.e. (s - mean) * n / (n - 1)."""
    scores = _sequence_scores(inputs)
    count, mean, _ = _group_stats(scores, _group_ids_for(inputs, "rloo"))
    loo = (scores - mean) * count / (count - 1).clamp(min=1)
    advantages = _broadcast(torch.where(count == 1, scores, loo), inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token discounted return (gamma) whitened over the batch; no critic, no groups."""
    returns = discounted_returns(inputs.token_level_rewards, inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus its group mean, given to every token, then whitened over all valid tokens of the batch."""
    scores = _sequence_scores(inputs)
    count, mean, _ = _group_stats(scores, _group_ids_for(inputs, "reinforce_plus_plus_baseline"))
    centred = scores - torch.where(count == 1, 0.0, mean)
    advantages = masked_whiten(_broadcast(centred, inputs.response_mask), inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("remax")
def remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-to-go minus the reward of the prompt's greedy response (`reward_baselines`)."""
    baselines = _require(inputs.reward_baselines, "reward_baselines (greedy rollout reward)", "remax")
    returns = discounted_returns(inputs.token_level_rewards, inputs.response_mask, 1.0)
    advantages = torch.where(inputs.response_mask.bool(), returns - baselines[:, None], 0.0)
    return advantages, returns


@register_adv_estimator("opo")
def opo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus the length-weighted group mean sum(len * s) / sum(len), the optimal baseline of OPO."""
    scores = _sequence_scores(inputs)
    ids = _group_ids_for(inputs, "opo")
    lengths = inputs.response_mask.bool().sum(dim=-1).to(scores.dtype)  # [B]
    num_groups = int(ids.max()) + 1
    weighted = scores.new_zeros(num_groups).index_add_(0, ids, lengths * scores)  # [G]
    total_length = scores.new_zeros(num_groups).index_add_(0, ids, lengths).clamp(min=1)  # [G]
    count, _, _ = _group_stats(scores, ids)
    baseline = torch.where(count == 1, 0.0, (weighted / total_length)[ids])
    advantages = _broadcast(scores - baseline, inputs.response_mask)
    return advantages, advantages
