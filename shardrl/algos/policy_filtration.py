"""Policy filtration (PF-PPO, Zhang et al. 2024, arXiv 2409.06957; verl's `algorithm.use_pf_ppo`): train on a batch
resampled towards the responses whose reward is most reliable.

A learned reward model is most accurate at its extremes, so PF-PPO draws the step's batch again, with replacement
and as many samples, weighting each response by its score: `pow` weighs |score|^weight_pow, `max_min` keeps only the
batch's best and worst scores, `max_random` weighs the best 0.4 and every other 0.1. Every weight gets 1e-8 so no
response is impossible (a batch of equal `max_min` scores, or of zeros under `pow`, draws uniformly). verl applies it
after GAE's advantages, and so does shardrl: the resampled batch carries each drawn sample's advantages and returns,
and both the critic and the actor train on it.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch

ReweightMethod = Literal["pow", "max_min", "max_random"]
REWEIGHT_METHODS: tuple[str, ...] = get_args(ReweightMethod)


@dataclass(frozen=True)
class PolicyFiltration:
    """verl's `algorithm.pf_ppo.reweight_method` and `.weight_pow` (read by `pow` only)."""

    reweight_method: ReweightMethod = "pow"
    weight_pow: float = 2.0

    def __post_init__(self) -> None:
        if self.reweight_method not in REWEIGHT_METHODS:
            raise ValueError(f"algorithm.pf_ppo.reweight_method must be one of {list(REWEIGHT_METHODS)}; "
                             f"got {self.reweight_method!r}")


def filtration_weights(scores: torch.Tensor, settings: PolicyFiltration) -> torch.Tensor:
    """Each response's (unnormalised) draw weight `[B]` from its score `[B]` (its token scores summed)."""
    if settings.reweight_method == "pow":
        weights = scores.abs().pow(settings.weight_pow)
    elif settings.reweight_method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    else:
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    return (weights + 1e-8).clamp(min=1e-8)


def resampled_rows(scores: torch.Tensor, settings: PolicyFiltration, generator: torch.Generator) -> torch.Tensor:
    """The rows `[B]` (int64) of the resampled batch: B draws with replacement in proportion to
    `filtration_weights`, from `generator` (seeded per step, so a resumed run draws the same)."""
    weights = filtration_weights(scores.double(), settings)
    return torch.multinomial(weights, scores.numel(), replacement=True, generator=generator)
