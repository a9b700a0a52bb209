"""Turning per-token losses into one scalar that does not depend on how the mini batch was cut.

A PPO mini batch is split into micro batches (fixed size or token-budget packing) and across data-parallel ranks.
If each micro batch divided by its own token count, the gradient would change with the cut: a micro batch with 10
tokens would weigh as much as one with 1000. Instead every piece divides its *sum* by counts of the whole mini batch
(`LossScale`), so the pieces' losses and gradients add up exactly to the full-batch ones. The trainer therefore sums
micro-batch gradients and SUMS (never averages) gradients over data-parallel ranks. (verl's `agg_loss` takes the
same global counts and multiplies each rank's share by dp_size, because its DDP averages gradients: the same result.)

Metrics follow the same rule: `scaled_token_mean` returns a piece's share of the mini-batch mean, so the trainer adds
metric values over micro batches and data-parallel ranks to get the exact mini-batch mean.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(frozen=True)
class LossScale:
    """Global counts of one mini batch (all micro batches, all data-parallel ranks), passed into every piece.

    num_tokens: valid response tokens (response_mask == 1).
    num_seqs: sequences with at least one valid token. Rows without any (pad-to-divisor filler, fully rejected
        samples) are not counted, so padding a batch never changes the loss.
    max_response_length: the constant divisor of seq-mean-token-sum-norm: verl's `loss_scale_factor`
        (`actor.loss_scale_factor`, else the rollout's response length; the critic's is the response length).
    """

    num_tokens: float
    num_seqs: float
    max_response_length: int

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.num_seqs < 0 or self.max_response_length <= 0:
            raise ValueError(
                f"LossScale needs num_tokens, num_seqs >= 0 and max_response_length > 0; got num_tokens="
                f"{self.num_tokens}, num_seqs={self.num_seqs}, max_response_length={self.max_response_length}"
            )

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor, max_response_length: int) -> "LossScale":
        """Scale for a batch processed as one piece (single rank, no micro batching, tests)."""
        num_tokens, num_seqs = loss_counts(response_mask).tolist()
        return cls(num_tokens, num_seqs, max_response_length)


def loss_counts(response_mask: torch.Tensor) -> torch.Tensor:
    """This piece's (num_tokens, num_seqs) as a float64 tensor `[2]`.

    The trainer adds these over the micro batches of a mini batch and all-reduces (SUM) over data-parallel ranks,
    then builds `LossScale(total[0], total[1], max_response_length)`. float64 keeps token counts exact.
    """
    valid = response_mask.bool()  # [B, T]
    return torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.float64)


def aggregate_loss(
    per_token: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, scale: LossScale
) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` to this piece's share of the mini-batch loss (a scalar).

    With l_it the loss of sequence i's valid token t, L_i its valid tokens, N = scale.num_tokens, G = scale.num_seqs
    and M = scale.max_response_length (counts of the whole mini batch over micro batches and DP ranks):
    token-mean:              sum_it l_it / N.
    token-sum:               sum_it l_it: no normalisation, so the loss grows with the mini batch (verl 0.9's).
    seq-mean-token-sum:      sum_i (sum_t l_it) / G.
    seq-mean-token-mean:     sum_i (sum_t l_it / L_i) / G. A sequence never spans pieces, so its token mean is local.
    seq-mean-token-sum-norm: sum_it l_it / G / M (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, as verl 0.9 has it:
                             the mean over sequences of their token sums, over a constant length). M is a constant of
                             the run, not the padded width of the piece (verl's default when `loss_scale_factor` is
                             null), which varies with packing and would make the loss depend on how the batch was cut.
    Sequences without a valid token count in neither N nor G. Empty counts are clamped to 1: an all-masked mini batch
    then gives 0 rather than NaN.
    """
    valid = response_mask.bool()  # [B, T]
    # where, not multiply: masked positions may hold inf/NaN (e.g. exp of a padding log-prob) and 0 * inf is NaN.
    token_sums = torch.where(valid, per_token, 0.0).sum(dim=-1)  # [B]
    num_seqs = max(scale.num_seqs, 1.0)
    if loss_agg_mode == "token-mean":
        return token_sums.sum() / max(scale.num_tokens, 1.0)
    if loss_agg_mode == "token-sum":
        return token_sums.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        seq_lengths = valid.sum(dim=-1).clamp(min=1)  # [B]
        return (token_sums / seq_lengths).sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return token_sums.sum() / num_seqs / scale.max_response_length
    raise ValueError(f"actor.loss_agg_mode={loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")


def scaled_token_mean(values: torch.Tensor, response_mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """This piece's share of the mini-batch token mean of `values` `[B, T]` (a detached scalar metric).

    Adding the results of all pieces gives the exact mean over the mini batch's valid tokens.
    """
    valid = response_mask.bool()
    return torch.where(valid, values.detach(), 0.0).sum() / max(scale.num_tokens, 1.0)
