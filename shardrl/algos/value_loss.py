"""The critic's objective: squared error to the returns, with PPO-style clipping of the value update.

Like the actor loss it is called per micro batch with the mini batch's `LossScale` and aggregated with
`aggregate_loss`, so micro-batch losses, gradients and metrics add up to the mini-batch ones.
"""

import torch

from shardrl.algos.aggregate import LossScale, aggregate_loss, scaled_token_mean


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    loss_agg_mode: str,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro batch's share of 0.5 * agg(max((v - R)^2, (v_clip - R)^2)) and its metrics.

    vpreds `[B, T]`: the critic's current predictions; values `[B, T]`: its predictions when the batch was made;
    returns `[B, T]`: the targets. v_clip keeps the new prediction within `critic.cliprange_value` of the old one;
    taking the larger error means a prediction that moved too far gains nothing by having moved (the PPO value
    clip), so the critic cannot jump on one batch.
    As verl 0.9's `compute_value_loss`, the aggregation (`critic.loss_agg_mode`) uses the mini batch's global counts,
    as the actor's does; seq-mean-token-sum-norm divides by `scale.max_response_length` (the response length).
    Metrics: vf_loss, vf_clipfrac (the clipped error is the larger one), vpred_mean.
    """
    valid = response_mask.bool()  # [B, T]
    # where on the inputs, not only on the loss: padding may hold inf/NaN (a prediction or target never written),
    # and although aggregate_loss drops its error, the error's gradient there, 0 * 2 (v - R), would be NaN.
    vpreds, values, returns = (torch.where(valid, x, 0.0) for x in (vpreds, values, returns))
    # Clamped between bounds (verl's clip_by_value), not values + clamp(vpreds - values): inside the bounds that
    # rounds away from vpreds by an ulp, and vf_clipfrac would count the noise as clipping.
    vpreds_clipped = vpreds.clamp(values - cliprange_value, values + cliprange_value)  # [B, T]
    unclipped = (vpreds - returns).square()
    clipped = (vpreds_clipped - returns).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, scale)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": scaled_token_mean((clipped > unclipped).float(), response_mask, scale),
        "vpred_mean": scaled_token_mean(vpreds, response_mask, scale),
    }
    return loss, metrics
