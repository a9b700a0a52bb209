"""On-policy distillation (verl's `distillation.distillation_loss`): the student samples, a frozen teacher scores
the sampled tokens, and the student learns to make the teacher's choices likely.

Per sampled token, `d = estimator(log p_student, log p_teacher)`, one of the KL(student || teacher) estimators of
algos.kl (k1 = log p_s - log p_t, k3 = r - 1 - log r with r = p_t / p_s, ...), both log-probs first clamped below at
`log_prob_min_clamp` and `d` clamped to [-loss_max_clamp, loss_max_clamp]. Then, as verl does:

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
    estimator: str  # an algos.kl estimator name
    use_policy_gradient: bool
    use_task_rewards: bool
    coef: float  # the distillation term's weight beside the task loss (1 when it trains alone)
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None
    clip: ClipRange  # the policy-gradient form's clip range


def distillation_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                      response_mask: torch.Tensor, scale: LossScale, loss_agg_mode: str,
                      settings: DistillationSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro batch's share of the distillation loss and its metrics; all tensors `[B, T]`.

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
    metrics = {"reverse_kl": scaled_token_mean((student - teacher).detach(), response_mask, scale),
               "abs_loss": scaled_token_mean(per_token.detach().abs(), response_mask, scale)}
    if settings.loss_max_clamp is not None:
        per_token = per_token.clamp(-settings.loss_max_clamp, settings.loss_max_clamp)
    if not settings.use_policy_gradient:
        return aggregate_loss(per_token, response_mask, loss_agg_mode, scale), metrics
    anchor = torch.where(valid, old_log_prob, 0.0)
    surrogate, pg_metrics = ppo_clip_loss(torch.where(valid, log_prob, 0.0), anchor, -per_token.detach(),
                                          response_mask, scale, settings.clip)
    metrics |= {"pg_clipfrac": pg_metrics["pg_clipfrac"], "ppo_kl": pg_metrics["ppo_kl"]}
    return aggregate_loss(surrogate, response_mask, loss_agg_mode, scale), metrics
