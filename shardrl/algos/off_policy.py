"""Off-policy correction: which log-probs anchor the PPO ratio, and which importance weights scale the loss.

Three policies can be in play for one sample:
- behaviour (pi_behav): the rollout engine's weights when the tokens were sampled (`rollout_log_probs`). Under the
  async modes it may be several versions old; even in sync mode the engine's numerics differ from the trainer's.
- proximal / old (pi_old): the trainer's weights at the start of this update, recomputed (`old_log_probs`).
- current (pi): the weights being optimised.

`algorithm.rollout_correction` chooses the treatment, all behind `rollout_correction`, which the trainer calls once
per step on the whole batch, whatever the mode:
- decoupled=true (three policies): the PPO ratio is pi / pi_old, so the trust region is around the trainer's own
  weights, and `rollout_is` = token | sequence multiplies the loss by the truncated weight
  w = min(pi_old / pi_behav, rollout_is_threshold) (decoupled PPO; truncated IS, "TIS"). rollout_is=null gives w = 1
  (verl's default: recompute old log-probs, no correction).
- decoupled=false (bypass, two policies): the behaviour log-probs are the anchor (ratio pi / pi_behav), which
  corrects for the behaviour policy inside the ratio and spares the old-log-prob forward pass. There is no second
  policy to weight against here, so rollout_is must be null; verl's bypass REINFORCE (`loss_type=reinforce`)
  weighs each micro batch against the current policy inside the loss instead (`actor_loss`'s `bypass_is`).
Token-level weights use each token's own ratio (biased, low variance); sequence-level weights use the product of the
sequence's token ratios, exp(sum of log ratios over valid tokens) (unbiased before truncation, high
variance). Weights are computed in log space and truncated there, so no overflow is possible, and are detached:
they re-weight samples, they are not something to optimise. `rollout_is_batch_normalize` then divides them by their
mean over the batch (token level: over valid tokens; sequence level: over sequences), as verl does.

With decoupled=true, `rollout_rs` / `rollout_token_veto_threshold` (shardrl.algos.rejection) also reject tokens or
sequences: the result's `response_mask` keeps only the others, and the trainer trains (and counts) on that mask.
IS weights and their normalisation are computed on the mask before rejection, as in verl.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from shardrl.algos.kl import LOG_RATIO_BOUND
from shardrl.algos.masked import masked_mean, masked_sum
from shardrl.algos.rejection import RejectionSampling, rejection_mask

RolloutIS = Literal["token", "sequence"] | None
# A weight mean at or below this is left alone by rollout_is_batch_normalize (verl's guard against dividing by ~0).
NORMALIZE_MIN_MEAN = 1e-8


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What the actor loss needs: its PPO anchor, detached weights, and whole-batch diagnostics."""

    old_log_prob: torch.Tensor  # [B, T] the anchor pi_old of the PPO ratio
    is_weights: torch.Tensor  # [B, T] multiplies the per-token policy-gradient loss; 1 where not corrected
    response_mask: torch.Tensor  # [B, T] the tokens to train on: the given mask less the rejected tokens
    metrics: dict[str, torch.Tensor]


def rollout_correction(
    old_log_prob: torch.Tensor | None,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_is: RolloutIS,
    rollout_is_threshold: float,
    decoupled: bool,
    *,
    rollout_is_batch_normalize: bool = False,
    rejection: RejectionSampling | None = None,
) -> OffPolicyCorrection:
    """Anchor, truncated IS weights `[B, T]`, kept tokens `[B, T]` and metrics for `algorithm.rollout_correction`.

    old_log_prob may be None only with decoupled=false (bypass skips the recompute); rollout_log_prob may be None
    only with decoupled=true, rollout_is=null and no rejection. Metrics (whole-batch, over valid tokens):
    mismatch_kl and mismatch_k3_kl (k1 and k3 estimates of KL(behaviour || old), whenever both log-probs are given),
    and with rollout_is set: rollout_is_mean (truncated weights, before normalisation), rollout_is_max (before
    truncation), rollout_is_truncated_frac (of valid tokens for token level, of sequences for sequence level) and
    with rollout_is_batch_normalize rollout_is_batch_norm_factor (the mean divided by); with rejection its metrics
    (`rejection_mask`).
    """
    anchor = _anchor(old_log_prob, rollout_log_prob, rollout_is, decoupled, rejection, rollout_is_batch_normalize)
    metrics: dict[str, torch.Tensor] = {}
    if old_log_prob is not None and rollout_log_prob is not None:
        metrics.update(mismatch_metrics(old_log_prob, rollout_log_prob, response_mask))
    weights = torch.ones_like(anchor)
    if rollout_is is not None:
        weights, is_metrics = truncated_is_weights(
            old_log_prob - rollout_log_prob, response_mask, rollout_is, rollout_is_threshold
        )
        metrics |= is_metrics
        if rollout_is_batch_normalize:
            weights, metrics["rollout_is_batch_norm_factor"] = normalize_is_weights(weights, response_mask, rollout_is)
    kept = response_mask
    if rejection is not None:
        kept_tokens, rejection_metrics = rejection_mask(old_log_prob - rollout_log_prob, response_mask, rejection)
        kept, metrics = kept_tokens.to(response_mask.dtype), metrics | rejection_metrics
    return OffPolicyCorrection(anchor.detach(), weights, kept, metrics)


def _anchor(
    old_log_prob: torch.Tensor | None,
    rollout_log_prob: torch.Tensor | None,
    rollout_is: RolloutIS,
    decoupled: bool,
    rejection: RejectionSampling | None,
    batch_normalize: bool,
) -> torch.Tensor:
    """The PPO anchor of the mode; refuses a mode whose inputs are missing or that cannot apply the correction."""
    given = (
        f"rollout_is={rollout_is!r}, rejection {'set' if rejection is not None else 'off'}, "
        f"old_log_probs {_presence(old_log_prob)}, rollout_log_probs {_presence(rollout_log_prob)}"
    )
    if batch_normalize and rollout_is is None:
        raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize=true normalises importance weights; "
                         "set rollout_is to token or sequence")
    if decoupled:
        needs_behaviour = rollout_is is not None or rejection is not None
        if old_log_prob is None or (needs_behaviour and rollout_log_prob is None):
            raise ValueError(
                "algorithm.rollout_correction.decoupled=true needs recomputed old_log_probs, and rollout_log_probs "
                f"when rollout_is or rejection sampling is set; got {given}"
            )
        return old_log_prob
    if rollout_is is not None or rejection is not None or rollout_log_prob is None:
        raise ValueError(
            "algorithm.rollout_correction.decoupled=false anchors PPO on the rollout log-probs, so it needs "
            f"rollout_log_probs, rollout_is=null and no rejection sampling; got {given}"
        )
    return rollout_log_prob


def _presence(log_prob: torch.Tensor | None) -> str:
    return "missing" if log_prob is None else "present"


def truncated_is_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """min(exp(log_ratio), threshold) per token or per sequence, as detached weights `[B, T]` (1 at masked tokens).

    log_ratio `[B, T]` is log pi_old - log pi_behav. Sequence level sums it over each sequence's valid tokens.
    """
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0; got {threshold}")
    valid = response_mask.bool()
    log_ratio = log_ratio.detach()
    if level == "token":
        log_weights = log_ratio  # [B, T]
        truncated_frac = masked_mean((log_weights > math.log(threshold)).float(), valid)
    elif level == "sequence":
        sequence_log_weights = masked_sum(log_ratio, valid, dim=-1)  # [B]
        has_tokens = valid.any(dim=-1)
        truncated = (sequence_log_weights > math.log(threshold)) & has_tokens
        truncated_frac = truncated.sum() / has_tokens.sum().clamp(min=1)
        log_weights = sequence_log_weights[:, None].expand_as(log_ratio)  # [B, T]
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} is not one of ['token', 'sequence', null]")
    weights = torch.where(valid, log_weights.clamp(max=math.log(threshold)).exp(), 1.0)  # [B, T]
    raw_max = torch.where(valid, log_weights, -math.inf).max().clamp(max=LOG_RATIO_BOUND).exp()
    metrics = {
        "rollout_is_mean": masked_mean(weights, valid),
        "rollout_is_max": raw_max,
        "rollout_is_truncated_frac": truncated_frac,
    }
    return weights, metrics


def normalize_is_weights(
    weights: torch.Tensor, response_mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout_is_batch_normalize`: the truncated weights `[B, T]` divided by their batch mean, and that mean.

    The mean is verl's: over valid tokens for token level, over sequences with valid tokens (one weight each) for
    sequence level. It is taken over the whole batch the controller holds, i.e. over all DP ranks' samples. A mean
    of at most NORMALIZE_MIN_MEAN leaves the weights as they are (factor 1). Masked tokens keep weight 1.
    """
    valid = response_mask.bool()
    if level == "token":
        mean = masked_mean(weights, valid)
    else:
        has_tokens = valid.any(dim=-1)  # [B]
        mean = masked_mean(masked_mean(weights, valid, dim=-1), has_tokens)
    if mean <= NORMALIZE_MIN_MEAN:
        return weights, torch.ones_like(mean)
    return torch.where(valid, weights / mean, 1.0), mean


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """k1 and k3 estimates of KL(behaviour || old) on the sampled tokens: how far the rollout is off-policy."""
    log_ratio = (old_log_prob - rollout_log_prob).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    return {
        "mismatch_kl": masked_mean(-log_ratio, response_mask),
        "mismatch_k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1.0, response_mask),
    }
