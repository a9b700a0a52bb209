"""KL between the policy and the reference model: per-token estimators, KL in the reward, and its controllers.

Only the sampled token's log-prob is known under each model, so the KL is estimated per token from the log ratio
(Schulman's k1/k2/k3). verl's names are accepted: kl = k1, abs, mse = k2, low_var_kl = k3, and its straight-through
variants kl+ = k1+, abs+, low_var_kl+ = k3+: the value of the named estimator with the gradient of k2. k1 and k3 are
unbiased estimates of the KL but their gradients are not unbiased estimates of its gradient; k2's is.

KL can enter training twice, with the same estimators:
- in the reward (`algorithm.use_kl_in_reward`): `apply_kl_penalty` subtracts beta * KL from the token scores before
  advantages, with beta from a fixed or adaptive controller (`algorithm.kl_ctrl`);
- as a loss term (`actor.use_kl_loss`): `kl_estimate` per token, aggregated with the policy loss (see policy_loss).
"""

from dataclasses import dataclass

import torch

from shardrl.algos.masked import masked_mean

# exp() of a log ratio beyond +-20 overflows float16/bfloat16 ranges and says nothing useful about the KL.
LOG_RATIO_BOUND = 20.0
# k3 is clamped so a single token the reference finds absurd cannot dominate the loss or the reward.
K3_BOUND = 10.0

KL_ESTIMATORS: tuple[str, ...] = (
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"
)


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate `[B, T]` from the sampled tokens' log-probs `[B, T]`.

    kl/k1:      log p - log q (unbiased, can be negative per token).
    abs:        |log p - log q|.
    mse/k2:     0.5 * (log p - log q)^2 (biased, low variance; its gradient log p - log q is unbiased).
    low_var_kl/k3: q/p - log(q/p) - 1, computed from the clamped log ratio and clamped to [-10, 10]
                (unbiased, non-negative; the estimator GRPO uses).
    kl+/k1+, abs+, low_var_kl+/k3+: the value of the estimator before the "+", the gradient of k2 (unclamped, as
                verl's). Without autograd (the KL in the reward) they are the plain estimators.
    Where the log ratio is not finite (padding may hold inf/NaN) the k2 gradient is zero, so a masked position
    cannot put NaN into the gradient; the value there is left as it is for the caller's mask to drop.
    """
    if kl_type not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {kl_type!r} (kl_penalty / kl_loss_type) is not one of {list(KL_ESTIMATORS)}")
    log_ratio = log_prob - ref_log_prob  # [B, T]
    base = kl_type.removesuffix("+")
    if base in ("kl", "k1"):
        value = log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base in ("mse", "k2"):  # autograd of 0.5 * log_ratio^2 itself would give 0 * NaN = NaN at padding
        return 0.5 * log_ratio.square().detach() + _zero_with_k2_gradient(log_ratio)
    else:  # low_var_kl / k3
        ref_over_policy = torch.clamp(-log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # log(q/p)
        value = torch.clamp(ref_over_policy.exp() - ref_over_policy - 1, -K3_BOUND, K3_BOUND)
    if kl_type.endswith("+"):
        return value.detach() + _zero_with_k2_gradient(log_ratio)
    return value


def _zero_with_k2_gradient(log_ratio: torch.Tensor) -> torch.Tensor:
    """Zeros `[B, T]` whose gradient w.r.t. the log ratio is k2's, log_ratio, and zero where it is not finite.

    k2 - k2.detach() is exactly 0 for finite k2, so adding it leaves another estimator's value bitwise unchanged.
    """
    finite_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)  # [B, T]
    k2 = 0.5 * finite_ratio.square()
    return k2 - k2.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """token_level_rewards = token_level_scores - kl_coef * KL(old policy || reference), per valid token.

    Uses the old (rollout-time) log-probs: the penalty is part of the reward the samples earned, fixed before the
    update. Only the value enters the reward, so a "+" estimator gives its base's penalty (k3+ as k3), as in verl.
    Returns the rewards `[B, T]` and metrics: `reward_kl_penalty` (mean over sequences of each sequence's token-mean
    KL, the value to feed `KLController.update`) and `reward_kl_penalty_coeff` (beta used).
    """
    kl = torch.where(response_mask.bool(), kl_estimate(old_log_prob, ref_log_prob, kl_penalty), 0.0)  # [B, T]
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean()
    metrics = {
        "reward_kl_penalty": current_kl,
        "reward_kl_penalty_coeff": torch.tensor(kl_coef, device=rewards.device),
    }
    return rewards, metrics


@dataclass
class FixedKLController:
    """`algorithm.kl_ctrl.type=fixed`: beta stays at `kl_coef` for the whole run."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient ignores the observed KL; present so the trainer calls one interface."""


@dataclass
class AdaptiveKLController:
    """`algorithm.kl_ctrl.type=adaptive` (Ziegler et al. 2019): steer beta so the observed KL tracks `target_kl`.

    After each batch: error = clip(current_kl / target_kl - 1, -0.2, 0.2); beta *= 1 + error * n_steps / horizon.
    The clip bounds how fast beta moves when the KL is far off; `horizon` (in samples) sets the time constant.
    `value` is the current beta; save and restore it with the checkpoint.
    """

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta after a batch of `n_steps` samples whose mean KL was `current_kl`."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """The controller named by `algorithm.kl_ctrl.type`, starting at `algorithm.kl_ctrl.kl_coef`."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(value=kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or target_kl <= 0 or horizon is None or horizon <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.type=adaptive needs target_kl > 0 and horizon > 0; "
                f"got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(value=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kl_ctrl_type!r} is not one of ['fixed', 'adaptive']")
