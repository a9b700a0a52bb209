"""The built-in advantage estimators, with the meaning verl users know under the same names.

Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline, opo, gpg, grpo_passk) score a response by the sum of
its token rewards
over valid tokens (those of `score_mask` when given: the tokens as sampled, before rejection sampling) and give
that one number to every valid token; gdpo reads per-sample reward components instead. Group estimators compare a
response with the
other samples of the same prompt (`index`, the prompt uid); a prompt with a single sample has no group to compare
with and keeps its raw score (baseline 0, scale 1). Every result is zero at masked positions, and nothing stored at
a masked position (reward, value) affects any valid one.
"""

import math
import numbers
from collections.abc import Mapping, Sequence
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


def _group_normalise(scores: torch.Tensor, ids: torch.Tensor, by_std: bool) -> torch.Tensor:
    """GRPO's per-sample (score - group mean) / (group std + eps) `[B]`, or without the division; a single-sample
    group keeps its raw score."""
    count, mean, std = _group_stats(scores, ids)
    single = count == 1
    centred = scores - torch.where(single, 0.0, mean)
    if by_std:
        centred = centred / (torch.where(single, 1.0, std) + GRPO_EPS)
    return centred


def _flat_groups(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`[B]` True for the samples of groups of two or more whose scores are all exactly equal (no spread)."""
    num_groups = int(ids.max()) + 1
    top = scores.new_full((num_groups,), -torch.inf).scatter_reduce(0, ids, scores, "amax")  # [G]
    bottom = scores.new_full((num_groups,), torch.inf).scatter_reduce(0, ids, scores, "amin")  # [G]
    count = torch.bincount(ids, minlength=num_groups)  # [G]
    return ((count >= 2) & (top == bottom))[ids]


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


@register_adv_estimator("grpo_vectorized")  # verl's vectorised GRPO: the same maths (one-sample groups included)
@register_adv_estimator("grpo")
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(score - group mean), divided by the group std unless `norm_adv_by_std_in_grpo` is off (Dr. GRPO)."""
    scores = _sequence_scores(inputs)  # [B]
    centred = _group_normalise(scores, _group_ids_for(inputs, "grpo"), inputs.norm_adv_by_std_in_grpo)
    advantages = _broadcast(centred, inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("rloo")
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: score minus the mean of the *other* samples, i.e. (s - mean) * n / (n - 1); a
    one-sample group keeps its score."""
    return _leave_one_out(inputs, "rloo", alone_keeps_score=True)


@register_adv_estimator("rloo_vectorized")
def rloo_vectorized(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: `rloo`, except that a one-sample group gets 0 (nothing to compare it with)."""
    return _leave_one_out(inputs, "rloo_vectorized", alone_keeps_score=False)


def _leave_one_out(inputs: AdvantageInputs, estimator: str, alone_keeps_score: bool) -> tuple[torch.Tensor, ...]:
    scores = _sequence_scores(inputs)
    count, mean, _ = _group_stats(scores, _group_ids_for(inputs, estimator))
    loo = (scores - mean) * count / (count - 1).clamp(min=1)
    alone = scores if alone_keeps_score else torch.zeros_like(scores)
    advantages = _broadcast(torch.where(count == 1, alone, loo), inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token discounted return (gamma) whitened over the batch; no critic, no groups."""
    returns = discounted_returns(inputs.token_level_rewards, inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@register_adv_estimator("optimal_token_baseline")
def optimal_token_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's Optimal Token Baseline: A_t = G_t - B_t with G_t the reward-to-go (undiscounted) and, per prompt group
    and position t, B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) over the group's samples still running at t.

    W_it = sum_{j <= t} w_ij is the sample's accumulated path variance, w_j = 1 - 2 pi_j + sum_v pi_v^2 (the squared
    norm of the log-prob's score at step j: one minus twice the sampled token's probability plus the distribution's
    collision probability), times the squared rollout-correction weight where there is one. A sample alone in its
    group keeps baseline 0. As verl's `handle_zero_tail`: where one sample is strictly the longest of its group, its
    baseline is 0 past the second-longest length (only it is left there, and a baseline of its own return would
    cancel its signal). Returns are the G_t. Position t is the response position: in a multi-turn response whose
    tool outputs are masked, samples are compared at equal offsets from the response start
    (`tir_optimal_token_baseline` compares them at equal counts of generated tokens instead)."""
    returns, step_variance, valid, ids = _otb_inputs(inputs, "optimal_token_baseline")
    advantages = _otb_advantages(returns, step_variance, valid, ids)
    return advantages, returns


@register_adv_estimator("tir_optimal_token_baseline")
def tir_optimal_token_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's tool-integrated-reasoning Optimal Token Baseline: `optimal_token_baseline` with t counting each
    sample's valid tokens (the model's own, tool outputs skipped) instead of response positions, so the k-th
    generated token of one trajectory is compared with the k-th of the others however long the tool outputs in
    between. On single-turn responses (valid tokens a prefix) both are the same. Returns are the G_t at the
    response positions."""
    returns, step_variance, valid, ids = _otb_inputs(inputs, "tir_optimal_token_baseline")
    lengths = valid.sum(-1)  # [B]
    width = max(int(lengths.max()), 1) if lengths.numel() else 1
    rank = torch.where(valid, valid.cumsum(-1) - 1, width)  # [B, T] each valid token's index among its row's; pad
    spare = torch.zeros(valid.shape[0], width + 1, dtype=returns.dtype, device=returns.device)  # one spare column

    def compact(values: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, width]: the valid tokens moved left
        return spare.scatter(1, rank, torch.where(valid, values, 0.0))[:, :width]

    compact_valid = torch.arange(width, device=valid.device)[None, :] < lengths[:, None]  # [B, width]
    compact_advantages = _otb_advantages(compact(returns), compact(step_variance), compact_valid, ids)
    advantages = torch.where(valid, torch.cat([compact_advantages, spare[:, :1]], 1).gather(1, rank), 0.0)
    return advantages, returns


def _otb_inputs(inputs: AdvantageInputs, name: str) -> tuple[torch.Tensor, ...]:
    """(returns G_t [B, T] (0 at masked positions), per-step variance w_t [B, T], valid [B, T], group ids [B])."""
    old_log_probs = _require(inputs.old_log_probs, "old_log_probs", name)
    sum_pi_squared = _require(inputs.sum_pi_squared, "sum_pi_squared (actor.calculate_sum_pi_squared=true)", name)
    valid = inputs.response_mask.bool()
    rewards = torch.where(valid, inputs.token_level_rewards, 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # [B, T] reward-to-go
    step_variance = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared  # [B, T]
    if inputs.is_weights is not None:
        step_variance = step_variance * inputs.is_weights.square()
    return torch.where(valid, returns, 0.0), step_variance, valid, _group_ids_for(inputs, name)


def _otb_advantages(returns: torch.Tensor, step_variance: torch.Tensor, valid: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """G_t - B_t at the valid positions (0 elsewhere), with B_t the group's W-weighted mean return at column t."""
    path_variance = torch.where(valid, step_variance, 0.0).cumsum(-1)  # [B, T] W_t
    weight = torch.where(valid, path_variance, 0.0)
    num_groups = int(ids.max()) + 1
    numerator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, ids, returns * weight)  # [G, T]
    denominator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, ids, weight) + 1e-8
    baselines = (numerator / denominator)[ids]  # [B, T]
    count = torch.bincount(ids, minlength=num_groups)[ids]  # [B]
    baselines = torch.where((count > 1)[:, None], baselines, 0.0)
    baselines = torch.where(_lone_tail(valid, ids, num_groups), 0.0, baselines)
    return torch.where(valid, returns - baselines, 0.0)


def _lone_tail(valid: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B, T] True at the positions of a group's unique longest sample past its group's second-longest length."""
    lengths = valid.sum(-1)  # [B]
    longest = lengths.new_zeros(num_groups).scatter_reduce(0, ids, lengths, "amax")  # [G]
    is_longest = lengths == longest[ids]  # [B]
    unique = torch.bincount(ids[is_longest], minlength=num_groups)[ids] == 1  # [B] one sample holds the max
    others = torch.where(is_longest, -1, lengths)
    second = others.new_full((num_groups,), -1).scatter_reduce(0, ids, others, "amax")[ids]  # [B]; -1: none
    lone = is_longest & unique & (second >= 0)  # a group of one has no second: its baseline is 0 anyway
    positions = torch.arange(valid.shape[1], device=valid.device)
    return lone[:, None] & (positions[None, :] >= second.clamp(min=0)[:, None])


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


@register_adv_estimator("gpg")
def gpg(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): alpha * (score - group mean), never divided by the std.

    alpha = B / (B - M), with B the batch's samples and M those of groups whose scores are all equal: they get
    advantage 0 and no gradient, so alpha rescales the batch-mean gradient to a mean over the samples that carry
    one (the paper's accurate gradient estimation; its code divides the loss by (B - M) / B). verl 0.9's `gpg`
    takes B - M = the samples with a nonzero score instead. A single-sample group keeps its raw score and counts
    as valid; with no valid sample alpha is B and every advantage 0. `norm_adv_by_std_in_grpo` is not read.
    """
    scores = _sequence_scores(inputs)  # [B]
    ids = _group_ids_for(inputs, "gpg")
    flat = _flat_groups(scores, ids)  # [B]
    centred = torch.where(flat, 0.0, _group_normalise(scores, ids, by_std=False))
    alpha = len(scores) / (~flat).sum().clamp(min=1).to(scores.dtype)
    advantages = _broadcast(alpha * centred, inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("grpo_passk")
def grpo_passk(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (verl's `grpo_passk`, after arXiv 2503.19595): only each group's best sample gets a nonzero
    advantage, its lead over the runner-up (max - second max), divided by the group std (+ eps) unless
    `norm_adv_by_std_in_grpo` is off. A tie at the top gives the group 0. Needs at least two samples per group."""
    scores = _sequence_scores(inputs)  # [B]
    ids = _group_ids_for(inputs, "grpo_passk")
    count, _, std = _group_stats(scores, ids)
    if bool((count < 2).any()):
        raise ValueError("algorithm.adv_estimator=grpo_passk needs at least 2 samples per prompt "
                         "(actor_rollout_ref.rollout.n >= 2); a prompt group has 1")
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(ids[by_score], stable=True).indices]  # [B] grouped, each group best first
    grouped = ids[order]
    first = torch.cat([grouped.new_ones(1, dtype=torch.bool), grouped[1:] != grouped[:-1]]).nonzero().squeeze(-1)
    best, runner_up = order[first], order[first + 1]  # [G] each
    lead = scores[best] - scores[runner_up]
    if inputs.norm_adv_by_std_in_grpo:
        lead = lead / (std[best] + GRPO_EPS)
    advantages = _broadcast(torch.zeros_like(scores).index_put((best,), lead), inputs.response_mask)
    return advantages, advantages


@register_adv_estimator("gdpo")
def gdpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (Liu et al. 2026, arXiv 2601.05242; verl 0.9's `gdpo`): each reward component k is normalised in its
    group on its own, A_k = (r_k - group mean) / (group std + eps) (a single-sample group keeps r_k), the weighted
    sum sum_k w_k A_k is given to every valid token and whitened over all valid tokens of the batch.

    Normalising components apart keeps combinations that one summed reward would merge (0+1 and 1+0) apart, and a
    component with a large spread does not drown the others. The components are `reward_components` [K, B] (the
    reward function's extras named by `algorithm.gdpo_reward_keys`), not `token_level_rewards`, as in verl: an
    in-reward KL penalty or overlong shaping of the score does not enter. As in verl the batch whitening is over
    tokens (a response weighs by its length; the paper normalises over responses), and the std division always
    applies (`norm_adv_by_std_in_grpo` is not read).
    """
    components = _require(inputs.reward_components, "reward_components (algorithm.gdpo_reward_keys)", "gdpo")
    ids = _group_ids_for(inputs, "gdpo")
    num_components = components.shape[0]
    weights = [1.0] * num_components if inputs.reward_weights is None else list(inputs.reward_weights)
    if len(weights) != num_components:
        raise ValueError(f"gdpo: {len(weights)} reward weights for {num_components} reward components")
    total = torch.zeros_like(components[0])  # [B]
    for weight, component in zip(weights, components):
        total = total + weight * _group_normalise(component, ids, by_std=True)
    advantages = masked_whiten(_broadcast(total, inputs.response_mask), inputs.response_mask)
    return advantages, advantages


def gdpo_reward_components(extras: Mapping[str, Sequence], keys: Sequence[str],
                           num_samples: int) -> torch.Tensor:
    """`[K, B]` float32 reward components for gdpo from per-sample columns (`extras`: the reward function's dict
    entries other than "score", beside the batch's other columns); each value must be a finite number (or a bool)."""
    rows = []
    for key in keys:
        if key not in extras:
            raise ValueError(f"algorithm.gdpo_reward_keys: {key!r} is not a per-sample column of the batch (it has "
                             f"{sorted(extras)}); the reward function must return it in its dict beside 'score'")
        values = list(extras[key])
        bad = [i for i, v in enumerate(values) if not isinstance(v, numbers.Real) or not math.isfinite(v)]
        if len(values) != num_samples or bad:
            where = f"sample {bad[0]} has {values[bad[0]]!r}" if bad else f"{len(values)} values for {num_samples}"
            raise ValueError(f"algorithm.gdpo_reward_keys: {key!r} needs a finite number for every sample; {where}")
        rows.append([float(v) for v in values])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(keys), num_samples)
