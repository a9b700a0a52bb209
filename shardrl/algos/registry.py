"""Advantage estimators by name (`algorithm.adv_estimator`), so a user can add one without editing the trainer.

Every estimator takes one `AdvantageInputs` and returns (advantages, returns), both `[B, T]` and zero at masked
positions. Names are global to the process: registering a *different* function under a taken name is refused,
because silently replacing `grpo` would change a run's maths without a trace. Registering the same function again
(a module imported twice under one name) is harmless and allowed.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. Optional fields are needed only by the estimators that say so."""

    token_level_rewards: torch.Tensor  # [B, T] scores (minus the KL penalty when it is in the reward)
    response_mask: torch.Tensor  # [B, T] 1 on tokens the policy generated
    values: torch.Tensor | None = None  # [B, T] critic values (gae)
    index: Sequence | torch.Tensor | None = None  # [B] prompt uid shared by a prompt's samples (group estimators)
    reward_baselines: torch.Tensor | None = None  # [B] reward of the greedy response (remax)
    gamma: float = 1.0  # algorithm.gamma
    lam: float = 1.0  # algorithm.lam
    norm_adv_by_std_in_grpo: bool = True  # algorithm.norm_adv_by_std_in_grpo
    # [B, T] the tokens whose rewards make up an outcome score; None: response_mask. Under rejection sampling it is
    # the mask as sampled, so a rejected token's reward (or a rejected sequence's score) still counts, as in verl.
    score_mask: torch.Tensor | None = None
    # [K, B] the reward components gdpo normalises one by one (`algorithm.gdpo_reward_keys`, from the reward
    # function's per-sample extras) and their weights [K] (`algorithm.gdpo_reward_weights`; None: 1 each).
    reward_components: torch.Tensor | None = None
    reward_weights: Sequence[float] | None = None
    # (tir_)optimal_token_baseline: the old-logprob pass's log pi of each sampled token and sum over the vocabulary of pi^2
    # (`actor.calculate_sum_pi_squared`), both [B, T], and the rollout-correction weights [B, T] when there are any.
    old_log_probs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]

_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering `fn` as `algorithm.adv_estimator=<name>`; refuses another function under a taken name."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        existing = _ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"adv_estimator {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                f"refusing {fn.__module__}.{fn.__qualname__} (pick another name)"
            )
        _ESTIMATORS[name] = fn
        return fn

    return register


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered as `name`; the error lists the known names."""
    if name not in _ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={name!r} is not registered; known: {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[name]


def compute_advantage(adv_estimator: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) `[B, T]` from the estimator named by `algorithm.adv_estimator`."""
    return get_adv_estimator(adv_estimator)(inputs)
