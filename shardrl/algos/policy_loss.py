"""The actor's objective: a clipped surrogate, off-policy weights, entropy bonus, KL loss.

The surrogate is chosen by `actor.policy_loss.loss_mode` (verl's key and names): `vanilla`, PPO's per-token ratio
with clip-higher and dual clip; `gspo`, GSPO's per-sequence ratio (Zheng et al. 2025, arXiv 2507.18071); `gpg`, GPG's
plain policy gradient (Chu et al. 2025, arXiv 2504.02546); `cispo`, MiniMax-M1's clipped, detached IS weight on the
log-prob gradient (arXiv 2506.13585); `sapo`, SAPO's soft gate instead of the hard clip (Gao et al. 2025, arXiv
2511.20347); `geo_mean`, GMPO's geometric mean of the clipped token ratios per sequence (arXiv 2507.20673);
`dppo_tv` / `dppo_kl`, DPPO's trust region on the token probability itself (its total variation or binary KL;
arXiv 2602.04879); `dro`, direct reward optimisation with a quadratic log-ratio penalty; `clip_cov` / `kl_cov`,
Clip-Cov's and KL-Cov's restraint of the tokens whose log-prob and advantage covary most (arXiv 2505.22617; the
tokens are chosen per mini batch by `algos.covariance`). In bypass mode
`algorithm.rollout_correction.loss_type=reinforce` replaces it with REINFORCE.

Called once per micro batch with the mini batch's `LossScale`; every term is aggregated by `aggregate_loss` with the
same scale (and `loss_agg_mode`, except the sapo surrogate: seq-mean-token-mean, as in verl 0.9.1), so the
micro-batch losses (and their gradients) add up to the mini-batch loss, and each metric is the micro batch's share of
the mini-batch value (the trainer sums metrics over micro batches and DP ranks).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from shardrl.algos.aggregate import LossScale, aggregate_loss, scaled_token_mean
from shardrl.algos.kl import LOG_RATIO_BOUND, kl_estimate
from shardrl.algos.off_policy import truncated_is_weights

# Upper bound of GSPO's log sequence ratio (verl's value); there is no lower bound.
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class ClipRange:
    """The surrogates' trust-region settings with verl's names (`actor.clip_ratio`, `clip_ratio_low/high`,
    `clip_ratio_c`; SAPO's `policy_loss.tau_pos/tau_neg`).

    The ratio is clipped to [1 - low, 1 + high]; low and high default to clip_ratio. A larger high than low
    ("clip-higher", DAPO) lets unlikely tokens with positive advantage grow faster, which keeps entropy up.
    clip_ratio_c bounds the loss of negative-advantage tokens at -A * c (dual clip), so one token whose ratio
    exploded cannot dominate the update; only the vanilla loss has a dual clip (gspo ignores clip_ratio_c).
    weight_clip: the range clips a detached importance weight (cispo), not a trust region, so low >= 1 is allowed
    and means no lower bound (the paper's setting; verl's CISPO example sets clip_ratio_low=10).
    tau_pos / tau_neg: the temperatures of SAPO's soft gate for tokens with A > 0 / A <= 0 (only sapo reads them).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    weight_clip: bool = False
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float | None = None  # DRO's quadratic log-ratio penalty (only dro reads it; it needs one > 0)
    ppo_kl_coef: float = 0.1  # KL-Cov's |log ratio| penalty on its selected tokens (only kl_cov reads it)

    def __post_init__(self) -> None:
        if self.low < 0.0 or (self.low >= 1.0 and not self.weight_clip) or self.high < 0.0:
            raise ValueError(f"actor clip range needs 0 <= clip_ratio_low < 1 (any low >= 0 with loss_mode=cispo) "
                             f"and clip_ratio_high >= 0; got {self}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1 (dual-clip lower bound); got {self.clip_ratio_c}")
        if self.tau_pos <= 0.0 or self.tau_neg <= 0.0:
            raise ValueError(f"SAPO's tau_pos and tau_neg must be > 0; got {self.tau_pos}, {self.tau_neg}")
        if self.dro_beta is not None and self.dro_beta <= 0.0:
            raise ValueError(f"DRO's dro_beta must be > 0; got {self.dro_beta}")
        if self.ppo_kl_coef < 0.0:
            raise ValueError(f"KL-Cov's ppo_kl_coef must be >= 0; got {self.ppo_kl_coef}")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss `[B, T]` = -min(r A, clip(r) A), with the dual clip where A < 0; r = pi / pi_old.

    Metrics (shares of mini-batch token means): pg_clipfrac (the clipped branch is active), pg_clipfrac_lower (the
    dual-clip bound is active), ppo_kl (k1 estimate of KL(old || current)).
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    pessimistic = torch.maximum(unclipped, clipped)  # [B, T]
    dual_bound = -advantages * clip.clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(pessimistic, dual_bound), pessimistic)
    metrics = {
        "pg_clipfrac": scaled_token_mean((clipped > unclipped).float(), response_mask, scale),
        "pg_clipfrac_lower": scaled_token_mean(((pessimistic > dual_bound) & negative).float(), response_mask, scale),
        "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale),
    }
    return per_token, metrics


def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO-token loss `[B, T]` = -min(s_it A, clip(s_it) A) (Zheng et al. 2025, arXiv 2507.18071).

    s_i = exp(mean over sequence i's valid tokens of log(pi / pi_old)): the geometric mean of the token ratios, so
    the ratio (and its clipping) is per sequence, matching the sequence-level reward, and length normalisation keeps
    it on one scale for short and long responses. The gradient uses the GSPO-token form
    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]: value s_i on every token, gradient s_i * d log pi(y_it), which equals
    GSPO's sequence gradient when the advantage is constant over the sequence (GRPO-style advantages).
    The token mean inside s_i divides by the sequence's own token count: a sequence never spans micro batches, so
    unlike the aggregation it needs no global count. There is no dual clip (`clip.clip_ratio_c` is not used); the
    paper's clip range is tiny (low 3e-4, high 4e-4) because a per-token geometric mean stays close to 1.
    As in verl, `actor_loss` aggregates this surrogate with seq-mean-token-mean whatever `loss_agg_mode` says.
    Metrics (shares of mini-batch token means): pg_clipfrac (the clipped branch is active: the token gets no
    gradient), ppo_kl (k1 estimate of KL(old || current), unclamped).
    """
    valid = response_mask.bool()  # [B, T]
    # where: padding may hold inf/NaN log-probs, and a constant 0 there also keeps gradients off padding.
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0.0)  # [B, T]
    seq_log_ratio = log_ratio.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # [B] log s_i
    # log s_it: log_ratio - sg[log_ratio] is 0 in value, d log pi(y_it) in gradient.
    token_log_ratio = seq_log_ratio.detach()[:, None] + (log_ratio - log_ratio.detach())  # [B, T]
    # Clamped above at GSPO_LOG_RATIO_MAX (verl's 10: s_i <= 2.2e4) so exp stays finite; a sequence past it has
    # value -A * e^10 and no policy gradient (with A > 0 it is clipped anyway). Below, exp underflows harmlessly to 0.
    ratio = torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX).exp()  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    metrics = {
        "pg_clipfrac": scaled_token_mean((clipped > unclipped).float(), response_mask, scale),
        "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale),
    }
    return per_token, metrics


def reinforce_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token REINFORCE loss `[B, T]` = -A * log pi: verl's bypass mode with `rollout_correction.loss_type=
    reinforce`. No ratio and no clipping (`clip` is not used); the importance weights, if any, come from
    `actor_loss`'s `bypass_is`. old_log_prob (the behaviour log-probs in bypass mode) only enters ppo_kl, the k1
    estimate of KL(behaviour || current) (a share of the mini-batch token mean)."""
    metrics = {"ppo_kl": scaled_token_mean(old_log_prob - log_prob, response_mask, scale)}
    return -advantages * log_prob, metrics


def _valid_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) `[B, T]` on valid tokens, clamped to +-LOG_RATIO_BOUND, and 0 at masked positions: padding
    may hold inf/NaN log-probs, and a constant there keeps both the values and the gradients of padding finite."""
    return torch.where(valid, log_prob - old_log_prob, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def gpg_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GPG loss `[B, T]` = -A * log pi (Chu et al. 2025, arXiv 2504.02546; verl's `gpg`): the policy
    gradient itself, no ratio, no clipping (`clip` is not used), aggregated by `loss_agg_mode`. GPG's scale factor
    alpha lives in its advantages (`algorithm.adv_estimator=gpg`). Masked positions give 0 and no gradient, whatever
    they hold. Metrics: ppo_kl (k1 estimate of KL(old || current), a share of the mini-batch token mean)."""
    valid = response_mask.bool()
    per_token = -torch.where(valid, advantages, 0.0) * torch.where(valid, log_prob, 0.0)
    metrics = {"ppo_kl": scaled_token_mean(-_valid_log_ratio(log_prob, old_log_prob, valid), response_mask, scale)}
    return per_token, metrics


def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token CISPO loss `[B, T]` = -sg(clip(r, 1 - low, 1 + high)) * A * log pi (MiniMax-M1, arXiv 2506.13585;
    verl's `cispo`), r = pi / pi_old.

    Unlike PPO, a clipped token keeps its gradient: the clip bounds the (detached) importance weight that scales
    d log pi, so every token, however far its ratio moved, contributes sg(w) * A * d log pi. clip_ratio_low >= 1
    (`clip.weight_clip`) removes the lower bound, as the paper does; clip_ratio_c is not used. Aggregated by
    `loss_agg_mode` (the paper's is token-mean). Masked positions give 0 and no gradient, whatever they hold.
    Metrics (shares of mini-batch token means): pg_clipfrac (the weight was clipped), ppo_kl (k1 of KL(old || current)).
    """
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)  # [B, T] sg(clip(r))
    per_token = -weight * torch.where(valid, advantages, 0.0) * torch.where(valid, log_prob, 0.0)
    metrics = {
        "pg_clipfrac": scaled_token_mean((weight != ratio).float(), response_mask, scale),
        "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale),
    }
    return per_token, metrics


def sapo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token SAPO loss `[B, T]` = -f(r) * A with the soft gate f(r) = sigmoid(tau * (r - 1)) * 4 / tau
    (Gao et al. 2025, arXiv 2511.20347; verl's `sapo`), r = pi / pi_old, tau = tau_pos where A > 0, else tau_neg.

    f(1) = 2 / tau and f'(r) = 4 s (1 - s) with s = sigmoid(tau (r - 1)), which is 1 at r = 1: on policy the
    gradient is the plain policy gradient, and it fades smoothly as r leaves 1 (faster with a larger tau) instead of
    being cut at the clip bounds; a larger tau_neg damps negative-advantage tokens sooner. The hard clip keys are not
    used. As in verl, `actor_loss` aggregates this surrogate with seq-mean-token-mean whatever `loss_agg_mode` says
    (the paper's sequence-level mean). Masked positions give 0 and no gradient, whatever they hold.
    Metrics: ppo_kl (k1 estimate of KL(old || current), a share of the mini-batch token mean).
    """
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    advantages = torch.where(valid, advantages, 0.0)
    tau = torch.where(advantages > 0, clip.tau_pos, clip.tau_neg).to(log_ratio.dtype)  # [B, T]
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)  # [B, T] f(r)
    per_token = -gate * advantages
    metrics = {"ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale)}
    return per_token, metrics


def geo_mean_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO's loss (Zhao et al. 2025, arXiv 2507.20673; verl's `geo_mean`), one value per sequence on each of its
    tokens `[B, T]`: -mean_t(A) * exp(mean_t(clip_A(log r_t))), r = pi / pi_old.

    The geometric mean of the token ratios replaces PPO's arithmetic mean, so one token whose ratio runs away moves
    the sequence's objective far less. Each token's log ratio x is clipped on the side its advantage pushes it:
    min(x, high) where A > 0, max(x, -low) where A < 0 (`clip_ratio_low/high` bound the log ratio, not the ratio),
    and a token with A = 0 counts 0, as verl's sign(A) product does. `actor_loss` aggregates it with
    seq-mean-token-mean whatever `loss_agg_mode` says (verl's is a mean over sequences): each token holds its
    sequence's value, so the token mean is that value; importance weights enter as each sequence's geometric mean of
    its token weights, as verl's. clip_ratio_c is not used. Metrics (shares of mini-batch token means): pg_clipfrac /
    pg_clipfrac_lower (as verl's: the token's log ratio lies outside [-low, high], clipped or not, with A > 0 /
    A < 0), ppo_kl (k1 of KL(old || current))."""
    valid = response_mask.bool()
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0.0)  # [B, T]
    advantages = torch.where(valid, advantages, 0.0)
    bounded = log_ratio.clamp(-clip.low, clip.high)
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)  # [B, T]; 0 where A = 0
    lengths = valid.sum(dim=-1).clamp(min=1)  # [B]
    ratio = (clipped_log_ratio.sum(dim=-1) / lengths).exp()  # [B] the geometric mean
    mean_advantage = advantages.sum(dim=-1) / lengths  # [B]
    per_token = (-mean_advantage * ratio)[:, None].expand_as(log_ratio)
    outside = log_ratio != bounded
    metrics = {
        "pg_clipfrac": scaled_token_mean((outside & (advantages > 0)).float(), response_mask, scale),
        "pg_clipfrac_lower": scaled_token_mean((outside & (advantages < 0)).float(), response_mask, scale),
        "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale),
    }
    return per_token, metrics


def _dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
    inside: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ClipRange], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO's per-token loss `[B, T]` = -A * sg(min(r, clip_ratio_c)) * log pi where the token is inside its trust
    region (`inside(p, p_old, log_ratio, clip)`: [B, T] bool for A > 0 and for A < 0), else 0 (no gradient): a
    truncated-IS policy gradient (clip_ratio_c, verl's TIS bound; DPPO recommends a large one), and the region is a
    divergence of the token's probability, not a ratio band. Metrics (shares of mini-batch token means):
    pg_clipfrac (outside the region), pg_clipfrac_lower (inside, with the weight truncated), ppo_kl."""
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    advantages = torch.where(valid, advantages, 0.0)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=clip.clip_ratio_c).detach()
    log_prob = torch.where(valid, log_prob, 0.0)
    old_log_prob = torch.where(valid, old_log_prob, 0.0)
    region = inside(log_prob.detach().exp(), old_log_prob.exp(), log_ratio.detach(), clip)
    pass_through = torch.where(advantages > 0, region[0], region[1]).float()  # [B, T]
    per_token = -advantages * weight * log_prob * pass_through
    metrics = {
        "pg_clipfrac": scaled_token_mean(1.0 - pass_through, response_mask, scale),
        "pg_clipfrac_lower": scaled_token_mean((ratio > clip.clip_ratio_c).float() * pass_through, response_mask,
                                               scale),
        "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale),
    }
    return per_token, metrics


def _total_variation_region(prob: torch.Tensor, old_prob: torch.Tensor, log_ratio: torch.Tensor,
                            clip: ClipRange) -> tuple[torch.Tensor, torch.Tensor]:
    """DPPO-Binary-TV's region for A > 0 and for A < 0: p - p_old <= high, p - p_old >= -low."""
    return prob - old_prob <= clip.high, prob - old_prob >= -clip.low


def _binary_kl_region(prob: torch.Tensor, old_prob: torch.Tensor, log_ratio: torch.Tensor,
                      clip: ClipRange) -> tuple[torch.Tensor, torch.Tensor]:
    """DPPO-Binary-KL's region: the KL between the Bernoulli(p_old) and Bernoulli(p) of the token, at most high
    (A > 0) or low (A < 0), or any move against the advantage."""
    binary_kl = -old_prob * log_ratio + (1.0 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return (binary_kl <= clip.high) | (prob <= old_prob), (binary_kl <= clip.low) | (prob >= old_prob)


def dppo_tv_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, scale: LossScale, clip: ClipRange
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's `dppo_tv` (arXiv 2602.04879): `_dppo_loss` with the total-variation region."""
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, scale, clip, _total_variation_region)


def dppo_kl_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, scale: LossScale, clip: ClipRange
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's `dppo_kl` (arXiv 2602.04879): `_dppo_loss` with the binary-KL region."""
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, scale, clip, _binary_kl_region)


def dro_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    clip: ClipRange,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's `dro`: per-token -(A * log pi - beta / 2 * log(pi / pi_old)^2) `[B, T]`, beta = `clip.dro_beta`
    (`actor.policy_loss.dro_beta`): the policy gradient with a quadratic penalty that pulls the log ratio back to
    0, no clipping. Aggregated by `loss_agg_mode`. Metrics: ppo_kl (k1 of KL(old || current))."""
    if clip.dro_beta is None:
        raise ValueError("actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0")
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    advantages = torch.where(valid, advantages, 0.0)
    per_token = -(advantages * torch.where(valid, log_prob, 0.0) - 0.5 * clip.dro_beta * log_ratio.square())
    metrics = {"ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale)}
    return per_token, metrics


def ppo_clip_active(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    clip: ClipRange) -> torch.Tensor:
    """Where PPO's clip takes over (bool, any shape): -A clip(r) > -A r, so the token gets no gradient from the
    clipped surrogate; Clip-Cov never selects those tokens."""
    ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    return -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high) > -advantages * ratio


def clip_cov_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, scale: LossScale, clip: ClipRange, selected: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov's per-token loss `[B, T]` (verl's `clip_cov`): PPO's -min(r A, clip(r) A) without the dual clip,
    and 0 (no gradient) on the `selected` tokens (`algos.covariance.select_tokens`: high-covariance tokens that
    PPO's clip left alone). Metrics (shares of mini-batch token means): pg_clipfrac (as verl's: the fraction
    selected, not PPO's clip), ppo_kl (k1 of KL(old || current))."""
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    ratio = log_ratio.exp()
    pessimistic = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high))
    per_token = torch.where(selected, 0.0, pessimistic)
    metrics = {"pg_clipfrac": scaled_token_mean(selected.float(), response_mask, scale),
               "ppo_kl": scaled_token_mean(-log_ratio, response_mask, scale)}
    return per_token, metrics


def kl_cov_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, scale: LossScale, clip: ClipRange, selected: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov's per-token loss `[B, T]` (verl's `kl_cov`): the unclipped -r A, plus ppo_kl_coef * |log r| on the
    `selected` tokens (`algos.covariance.select_tokens`: the largest covariances); no clipping anywhere.
    Metrics: ppo_kl (as verl's for this loss: the mini-batch token mean of |log r|, a share of it)."""
    valid = response_mask.bool()
    log_ratio = _valid_log_ratio(log_prob, old_log_prob, valid)  # [B, T]
    penalty = torch.where(selected, clip.ppo_kl_coef * log_ratio.abs(), 0.0)
    per_token = -advantages * log_ratio.exp() + penalty
    return per_token, {"ppo_kl": scaled_token_mean(log_ratio.abs(), response_mask, scale)}


PolicyLossMode = Literal["vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "dro",
                         "clip_cov", "kl_cov"]
POLICY_LOSS_MODES: tuple[str, ...] = get_args(PolicyLossMode)
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossScale, ClipRange],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
# reinforce is chosen by algorithm.rollout_correction.loss_type (bypass mode), not by loss_mode.
_POLICY_LOSSES: dict[str, PolicyLossFn] = {"vanilla": ppo_clip_loss, "gspo": gspo_loss, "gpg": gpg_loss,
                                           "cispo": cispo_loss, "sapo": sapo_loss, "geo_mean": geo_mean_loss,
                                           "dppo_tv": dppo_tv_loss, "dppo_kl": dppo_kl_loss, "dro": dro_loss,
                                           "reinforce": reinforce_loss}
# Surrogates that also read which tokens `algos.covariance` selected over the mini batch.
_SELECTIVE_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}
# Surrogates whose policy-gradient term has its own aggregation (verl 0.9.1: SAPO's loss is a mean over sequences of
# token means, whatever `loss_agg_mode`; GSPO's follows `loss_agg_mode` since 0.9.1, the paper's being
# seq-mean-token-mean); entropy and KL terms always follow `loss_agg_mode`.
_FIXED_PG_AGG_MODES: dict[str, str] = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    loss_agg_mode: str,
    clip: ClipRange,
    is_weights: torch.Tensor | None = None,
    bypass_is: tuple[str, float] | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    loss_mode: str = "vanilla",
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro batch's share of the actor loss (a scalar to call backward on) and its metrics.

    loss = agg(w * surrogate) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(KL(pi || ref)).
    - loss_mode: the surrogate, `vanilla` (ppo_clip_loss), `gspo` (gspo_loss), `gpg` (gpg_loss), `cispo`
      (cispo_loss), `sapo` (sapo_loss), `geo_mean` (geo_mean_loss), `dppo_tv` / `dppo_kl` (_dppo_loss), `dro`
      (dro_loss), `clip_cov` / `kl_cov` (clip_cov_loss, kl_cov_loss: they need `selected` [B, T] bool, the
      tokens `algos.covariance.select_tokens` chose over the mini batch) or `reinforce` (reinforce_loss); sapo's
      and geo_mean's terms are always aggregated with seq-mean-token-mean, as in verl; the other terms do not
      change.
    - old_log_prob / is_weights: the anchor and the detached weights from `rollout_correction` (none: weights 1).
      The weights multiply only the policy-gradient term; entropy and KL terms are not importance-weighted.
    - bypass_is: (rollout_is, rollout_is_threshold) of verl's bypass-mode REINFORCE (loss_mode `reinforce`): the
      weights are the truncated ratios of the current policy to the anchor (the behaviour log-probs), per token or
      per sequence, recomputed in every micro batch and detached.
    - entropy `[B, T]`: pass it to get the `entropy` metric; required when entropy_coeff != 0.
    - ref_log_prob `[B, T]`: pass it when `actor.use_kl_loss` is on; the KL term uses `kl_loss_type`.
    Metrics: pg_loss, ppo_kl, pg_clipfrac (vanilla, gspo, cispo, geo_mean, dppo_*, clip_cov), pg_clipfrac_lower (vanilla: the
    dual clip; geo_mean: clipped with A < 0; dppo_*: the truncated weight), and entropy / kl_loss when present.
    """
    if loss_mode not in _POLICY_LOSSES and loss_mode not in _SELECTIVE_LOSSES:
        raise ValueError(f"actor.policy_loss.loss_mode={loss_mode!r} is not one of {list(POLICY_LOSS_MODES)}")
    if (selected is None) == (loss_mode in _SELECTIVE_LOSSES):
        raise ValueError(f"loss_mode={loss_mode!r}: `selected` (the covariance selection) is read by "
                         f"{list(_SELECTIVE_LOSSES)} only, and they need it")
    if bypass_is is not None:
        if loss_mode != "reinforce" or is_weights is not None:
            raise ValueError(f"bypass_is weighs the reinforce loss alone; got loss_mode={loss_mode!r} and "
                             f"is_weights {'given' if is_weights is not None else 'none'}")
        is_weights, _ = truncated_is_weights(log_prob.detach() - old_log_prob, response_mask, *bypass_is)
    valid = response_mask.bool()  # padding may hold anything in any input: it never reaches a term or a gradient
    advantages = torch.where(valid, advantages, 0.0)
    if is_weights is not None:
        is_weights = torch.where(valid, is_weights, 0.0)
    if selected is not None:
        pg_per_token, metrics = _SELECTIVE_LOSSES[loss_mode](log_prob, old_log_prob, advantages, response_mask,
                                                             scale, clip, selected & valid)
    else:
        pg_per_token, metrics = _POLICY_LOSSES[loss_mode](log_prob, old_log_prob, advantages, response_mask, scale,
                                                          clip)
    if is_weights is not None:
        if loss_mode == "geo_mean":  # a sequence's loss is weighted by the geometric mean of its token weights
            lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
            is_weights = (torch.where(valid, (is_weights + 1e-10).log(), 0.0).sum(-1, keepdim=True) / lengths).exp()
        pg_per_token = pg_per_token * is_weights.detach()
    pg_agg_mode = _FIXED_PG_AGG_MODES.get(loss_mode, loss_agg_mode)
    loss = aggregate_loss(pg_per_token, response_mask, pg_agg_mode, scale)
    metrics["pg_loss"] = loss.detach()
    if entropy_coeff != 0.0 and entropy is None:
        raise ValueError(f"actor.entropy_coeff={entropy_coeff} needs the per-token entropy; none was computed")
    if entropy is not None:
        entropy_term = aggregate_loss(entropy, response_mask, loss_agg_mode, scale)
        metrics["entropy"] = entropy_term.detach()
        if entropy_coeff != 0.0:  # with 0, skip it so backward does not run through the entropy computation
            loss = loss - entropy_coeff * entropy_term
    if ref_log_prob is not None:
        kl_term = aggregate_loss(kl_estimate(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode, scale)
        metrics["kl_loss"] = kl_term.detach()
        loss = loss + kl_loss_coef * kl_term
    return loss, metrics
