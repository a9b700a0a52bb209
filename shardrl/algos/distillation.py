"""On-policy distillation (verl's `distillation.distillation_loss`): the student samples, a frozen teacher scores
the sampled tokens, and the student learns to make the teacher's choices likely.

Per sampled token a divergence `d`, then clamped to [-loss_max_clamp, loss_max_clamp]:
* the estimators (`distillation_loss`): `d = estimator(log p_student, log p_teacher)` of the sampled token, one of the
  KL(student || teacher) estimators of algos.kl (k1 = log p_s - log p_t, k3 = r - 1 - log r with r = p_t / p_s,
  ...), both log-probs first clamped below at `log_prob_min_clamp`;
* `forward_kl_topk` (`topk_distillation_loss`): d = KL_k(teacher || student), the forward KL over the teacher's k
  most likely tokens of the position (computed over the vocab blocks: parallel/vocab_topk.py), floored at 0 (the
  top k do not hold all the mass, so it can dip below).
Then, as verl does:

* `use_policy_gradient=true` (Thinking Machines' on-policy distillation, best with k1): `-d`, detached, is each
  token's advantage in PPO's clipped surrogate against the anchor log-probs (the distillation's own clip range);
  the student's gradient flows through its log-prob of the sampled token only.
* `use_policy_gradient=false` (Gu et al. 2023, arXiv 2306.13649, best with k3): `d` itself is the loss, backpropagated
  through the student's log-prob (k1's gradient does not depend on the teacher, so k1 is refused there).

Either way the per-token term is aggregated like every actor term (`loss_agg_mode`, the mini batch's global counts),
so it is independent of micro-batching and DP. The actor adds it to the task loss times `coef` (use_task_rewards),
or trains on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardrl.algos.aggregate import LossScale, aggregate_loss, scaled_token_mean
from shardrl.algos.kl import kl_estimate
from shardrl.algos.policy_loss import ClipRange, ppo_clip_loss


@dataclass(frozen=True)
class DistillationSettings:
    estimator: str  # an algos.kl estimator name, or "forward_kl_topk"
    use_policy_gradient: bool
    use_task_rewards: bool
    coef: float  # the distillation term's weight beside the task loss (1 when it trains alone)
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None
    clip: ClipRange  # the policy-gradient form's clip range
    topk: int | None = None  # forward_kl_topk: the teacher's top k per position; None for the estimators

    @property
    def uses_topk(self) -> bool:
        return self.topk is not None


def distillation_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                      response_mask: torch.Tensor, scale: LossScale, loss_agg_mode: str,
                      settings: DistillationSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro batch's share of an estimator's distillation loss and its metrics; all tensors `[B, T]`.

    `log_prob` is the student's (with grad), `old_log_prob` the PPO anchor, `teacher_log_prob` the teacher's of the
    same sampled tokens. Metrics (shares of mini-batch token means): `reverse_kl` (the k1 estimate of KL(student ||
    teacher) on the student's own samples), `abs_loss` (|d| before the clamp), and the clipped surrogate's
    `pg_clipfrac` / `ppo_kl` in the policy-gradient form."""
    valid = response_mask.bool()
    student, teacher = log_prob, teacher_log_prob
    if settings.log_prob_min_clamp is not None:
        low = settings.log_prob_min_clamp
        student, teacher = student.clamp(min=low), teacher.clamp(min=low)
    # Padding may hold anything (NaN, -inf): it never reaches the estimator, so neither the loss nor its gradient.
    student = torch.where(valid, student, 0.0)
    teacher = torch.where(valid, teacher, 0.0)
    per_token = torch.where(valid, kl_estimate(student, teacher, settings.estimator), 0.0)  # [B, T]
    metrics = {"reverse_kl": scaled_token_mean((student - teacher).detach(), response_mask, scale)}
    return _objective(per_token, log_prob, old_log_prob, response_mask, scale, loss_agg_mode, settings, metrics)


@dataclass(frozen=True)
class TopKOverlap:
    """How far the student's top k overlap the teacher's, per position `[B, T]` (verl's diagnostics after "Rethinking
    On-Policy Distillation of Large Language Models", arXiv 2604.13016): `count`, the teacher's top-k ids also among
    the student's top k; `advantage_sum`, the sum over those ids of -p_t (log p_t - log p_s), the KL terms with the
    sign of an advantage (both log-probs clamped as the loss's)."""

    count: torch.Tensor
    advantage_sum: torch.Tensor


# forward_kl_topk's mean advantage over overlapping positions is a ratio of two mini-batch sums, each summed as the
# other metrics are (shares over micro batches and DP), then divided (`overlap_token_advantage`).
OVERLAP_ADVANTAGE_SUM, OVERLAP_POSITIONS = "overlap_advantage_sum", "overlap_positions"


def topk_distillation_loss(forward_kl: torch.Tensor, student_mass: torch.Tensor, teacher_mass: torch.Tensor,
                           log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                           scale: LossScale, loss_agg_mode: str, settings: DistillationSettings,
                           overlap: TopKOverlap) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro batch's share of forward_kl_topk's loss and its metrics; all tensors `[B, T]`.

    `forward_kl` is KL_k(teacher || student) of each position (differentiable in the student's logits), the masses
    the probability each gives the teacher's top k. Metrics: `student_mass`, `teacher_mass` (token means),
    `overlap_ratio` (token mean of the overlap count / k), `abs_loss` (|d| before the clamp), the policy-gradient
    form's `pg_clipfrac` / `ppo_kl`, and the two sums `overlap_token_advantage` divides (the mean over positions with
    any overlap of advantage_sum / count, verl's)."""
    valid = response_mask.bool()
    per_token = torch.where(valid, forward_kl, 0.0).clamp_min(0.0)  # [B, T]
    overlapping = valid & (overlap.count > 0)
    mean_advantage = torch.where(overlapping, overlap.advantage_sum / overlap.count.clamp_min(1.0), 0.0)
    metrics = {"student_mass": scaled_token_mean(torch.where(valid, student_mass, 0.0), response_mask, scale),
               "teacher_mass": scaled_token_mean(torch.where(valid, teacher_mass, 0.0), response_mask, scale),
               "overlap_ratio": scaled_token_mean(torch.where(valid, overlap.count, 0.0) / settings.topk,
                                                  response_mask, scale),
               OVERLAP_ADVANTAGE_SUM: scaled_token_mean(mean_advantage, response_mask, scale),
               OVERLAP_POSITIONS: scaled_token_mean(overlapping.float(), response_mask, scale)}
    return _objective(per_token, log_prob, old_log_prob, response_mask, scale, loss_agg_mode, settings, metrics)


def overlap_token_advantage(metrics: dict[str, list[float]]) -> dict[str, list[float]]:
    """An update's per-step metrics (the distillation term's under `distillation/`) with forward_kl_topk's two
    overlap sums replaced by their ratio, `distillation/overlap_token_advantage` (0 for a step without any
    overlapping position, as verl's)."""
    sums = metrics.pop(f"distillation/{OVERLAP_ADVANTAGE_SUM}")
    positions = metrics.pop(f"distillation/{OVERLAP_POSITIONS}")
    ratios = [total / count if count > 0 else 0.0 for total, count in zip(sums, positions)]
    return metrics | {"distillation/overlap_token_advantage": ratios}


def _objective(per_token: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor,
               response_mask: torch.Tensor, scale: LossScale, loss_agg_mode: str, settings: DistillationSettings,
               metrics: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token divergence d [B, T] (0 on padding), clamped, as the loss itself or as -d advantages of the
    clipped surrogate."""
    valid = response_mask.bool()
    metrics = metrics | {"abs_loss": scaled_token_mean(per_token.detach().abs(), response_mask, scale)}
    if settings.loss_max_clamp is not None:
        per_token = per_token.clamp(-settings.loss_max_clamp, settings.loss_max_clamp)
    if not settings.use_policy_gradient:
        return aggregate_loss(per_token, response_mask, loss_agg_mode, scale), metrics
    anchor = torch.where(valid, old_log_prob, 0.0)
    surrogate, pg_metrics = ppo_clip_loss(torch.where(valid, log_prob, 0.0), anchor, -per_token.detach(),
                                          response_mask, scale, settings.clip)
    metrics |= {"pg_clipfrac": pg_metrics["pg_clipfrac"], "ppo_kl": pg_metrics["ppo_kl"]}
    return aggregate_loss(surrogate, response_mask, loss_agg_mode, scale), metrics
