"""Clip-Cov and KL-Cov's token selection (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617; verl's `clip_cov` and `kl_cov` policy losses).

Entropy collapses through the few tokens whose log-prob and advantage covary most: raising a likely token's
probability when its advantage is high sharpens the policy fastest. Both losses single out a small fraction of a
mini batch's tokens by cov_t = (A_t - mean A) (log pi_t - mean log pi) over its valid tokens and restrain them:
Clip-Cov drops the gradient of `ratio` x N tokens drawn at random among those with cov in (lb, ub) that PPO's clip
left alone; KL-Cov adds a |log(pi / pi_old)| penalty to the `ratio` x N tokens of largest cov.

The selection is a function of the whole mini batch, so it is made here over its valid tokens as one flat vector
(every data-parallel rank's share, in rank order), once per optimizer step, from the log-probs of the policy that
step differentiates. verl selects within each micro batch instead, so there the fraction, the means and the random
draw change with the micro-batch size and the DP layout; here they do not.
"""

from dataclasses import dataclass
from typing import Literal

import torch

CovarianceMode = Literal["clip_cov", "kl_cov"]
COVARIANCE_MODES: tuple[str, ...] = ("clip_cov", "kl_cov")


@dataclass(frozen=True)
class CovarianceSelection:
    """verl's `actor.policy_loss` keys of the two losses: `ratio` is clip_cov_ratio or kl_cov_ratio (the fraction of
    the mini batch's valid tokens selected; at least one is), `lower` / `upper` are clip_cov_lb / clip_cov_ub (the
    open band of covariances Clip-Cov draws from; KL-Cov takes the largest whatever their value)."""

    mode: CovarianceMode
    ratio: float = 2e-4
    lower: float = 1.0
    upper: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in COVARIANCE_MODES:
            raise ValueError(f"covariance selection mode must be one of {list(COVARIANCE_MODES)}; got {self.mode!r}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"{self.mode}_ratio must be in (0, 1]; got {self.ratio}")
        if self.mode == "clip_cov" and not self.lower < self.upper:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub; got {self.lower} and {self.upper}")


def select_tokens(selection: CovarianceSelection, advantages: torch.Tensor, log_prob: torch.Tensor,
                  clipped: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The selected tokens `[N]` (bool) of a mini batch's N valid tokens given flat, in a fixed order.

    advantages / log_prob `[N]`: the tokens' advantages and log-probs under the policy being updated (detached);
    clipped `[N]` bool: PPO's clip is active on the token (Clip-Cov never selects those). Means and covariances are
    taken in float64. KL-Cov takes the max(1, int(N ratio)) largest covariances (ties: the earlier token). Clip-Cov
    takes max(1, int(ratio N)) tokens uniformly at random without replacement among its candidates (all of them if
    there are fewer), drawn with `generator` on the host so that every rank draws the same."""
    num_tokens = advantages.numel()
    chosen = torch.zeros(num_tokens, dtype=torch.bool, device=advantages.device)
    if num_tokens == 0:
        return chosen
    advantages, log_prob = advantages.double(), log_prob.double()
    covariance = (advantages - advantages.mean()) * (log_prob - log_prob.mean())  # [N]
    if selection.mode == "kl_cov":
        count = max(1, int(num_tokens * selection.ratio))
        order = torch.sort(covariance, descending=True, stable=True).indices
        return chosen.index_fill_(0, order[:count], True)
    candidates = (~clipped & (covariance > selection.lower) & (covariance < selection.upper)).nonzero()[:, 0]  # [C]
    count = max(int(selection.ratio * num_tokens), 1)
    draw = torch.randperm(candidates.numel(), generator=generator)[:count].to(candidates.device)
    return chosen.index_fill_(0, candidates[draw], True)
