"""RL algorithms as pure tensor functions: advantages, actor/critic losses, KL, off-policy correction.

No parallelism and no batch container here: tensors in, tensors and metric dicts out. Two kinds of call sites:
- whole batch, on the controller, once per step: `compute_advantage`, `apply_kl_penalty`, `rollout_correction`.
  Their metrics are plain means over the batch.
- per micro batch, in the workers: `actor_loss`, `value_loss`, with the mini batch's `LossScale`. Their losses and
  metrics are the micro batch's share of the mini-batch value: sum them over micro batches and data-parallel ranks.
"""

from shardrl.algos import advantages as _builtin_estimators  # noqa: F401  (registers gae, grpo, ... by import)
from shardrl.algos.advantages import gdpo_reward_components
from shardrl.algos.aggregate import LOSS_AGG_MODES, LossScale, aggregate_loss, loss_counts, scaled_token_mean
from shardrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
)
from shardrl.algos.off_policy import OffPolicyCorrection, mismatch_metrics, rollout_correction, truncated_is_weights
from shardrl.algos.policy_loss import (
    POLICY_LOSS_MODES,
    ClipRange,
    PolicyLossMode,
    actor_loss,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    sapo_loss,
)
from shardrl.algos.registry import AdvantageInputs, compute_advantage, get_adv_estimator, register_adv_estimator
from shardrl.algos.value_loss import value_loss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "ClipRange",
    "FixedKLController",
    "KLController",
    "LossScale",
    "OffPolicyCorrection",
    "PolicyLossMode",
    "actor_loss",
    "aggregate_loss",
    "apply_kl_penalty",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantage",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "gdpo_reward_components",
    "geo_mean_loss",
    "get_adv_estimator",
    "gpg_loss",
    "gspo_loss",
    "kl_cov_loss",
    "kl_estimate",
    "loss_counts",
    "make_kl_controller",
    "ppo_clip_loss",
    "register_adv_estimator",
    "mismatch_metrics",
    "rollout_correction",
    "sapo_loss",
    "scaled_token_mean",
    "truncated_is_weights",
    "value_loss",
]
