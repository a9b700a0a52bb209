"""Rejection sampling of off-policy tokens: verl's `algorithm.rollout_correction.rollout_rs`.

Importance weights re-weight the samples whose trainer and rollout log-probs disagree; rejection sampling drops
them. A token (or a whole sequence) whose statistic of log r = log pi_old - log pi_behav falls outside bounds leaves
the response mask, so it drops out of the losses and out of the token / sequence counts that normalise them
(`LossScale`), for the actor and the critic alike. It runs once per step on the whole batch (`rollout_correction`).

verl has had two spellings; their option names do not overlap, so both are accepted:
- verl 0.6.1 - 0.7 ("ratio" criteria): `rollout_rs` = token | sequence | geometric keeps tokens whose ratio r, or
  sequences whose ratio exp(sum log r) or geometric mean exp(mean log r), lie in [lower, upper] (the log clamped to
  +-20 before exp): upper = `rollout_rs_threshold`, lower = `rollout_rs_threshold_lower` (null: 1 / upper).
- verl after 0.7 ("divergence" criteria): `rollout_rs` is a comma list of token_k{1,2,3}, seq_sum_k{1,2,3},
  seq_mean_k{1,2,3}, seq_max_k{2,3}, all of which must pass. Per token (log r clamped to +-20 first) k1 = -log r,
  k2 = (log r)^2 / 2, k3 = r - 1 - log r, estimates of KL(behaviour || old); seq_* reduce them over the sequence's
  valid tokens. `rollout_rs_threshold` holds one spec per criterion, or one for all, comma-separated: k2 / k3 an
  upper bound; k1 `lower_upper` (or one upper, lower = 1 / upper), keeping log(lower) <= k1 <= log(upper). k1 bounds
  pi_behav / pi_old, the inverse of the ratio the older spelling bounds: the same only for bounds symmetric in log.
`rollout_token_veto_threshold` (verl 0.6.1 - 0.7, with either spelling or alone) drops every sequence holding a valid
token with r below it (unclamped).
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from shardrl.algos.kl import LOG_RATIO_BOUND
from shardrl.algos.masked import masked_mean, masked_sum

Estimator = Literal["ratio", "k1", "k2", "k3"]
Reduction = Literal["token", "sum", "mean", "max"]  # per token, or over a sequence's valid tokens

RATIO_OPTIONS: dict[str, Reduction] = {"token": "token", "sequence": "sum", "geometric": "mean"}
_DIVERGENCE_REDUCTIONS: dict[str, Reduction] = {"token": "token", "seq_sum": "sum", "seq_mean": "mean",
                                                "seq_max": "max"}
DIVERGENCE_OPTIONS: tuple[str, ...] = tuple(f"{level}_{k}" for level in _DIVERGENCE_REDUCTIONS
                                            for k in ("k1", "k2", "k3") if (level, k) != ("seq_max", "k1"))


class RejectionSpecError(ValueError):
    """A rejection-sampling setting that cannot be used; `key` is the key under algorithm.rollout_correction."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"algorithm.rollout_correction.{key}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class Criterion:
    """One test: a statistic per token or per sequence, kept where lower <= statistic <= upper."""

    name: str  # verl's option name
    estimator: Estimator  # ratio: r itself (exp after the reduction); k1/k2/k3: the KL estimate per token
    reduction: Reduction
    lower: float | None  # in the statistic's units (log units for k1); None: no lower bound
    upper: float

    @property
    def metric_prefix(self) -> str:
        """verl's metric names: rollout_rs_<stat> for the single ratio criterion, rollout_rs_<option>_<stat> else."""
        return "rollout_rs" if self.estimator == "ratio" else f"rollout_rs_{self.name}"

    @property
    def fraction_prefix(self) -> str:
        return f"{self.metric_prefix}_ratio_fraction" if self.estimator == "ratio" else f"{self.metric_prefix}_fraction"


@dataclass(frozen=True)
class RejectionSampling:
    criteria: tuple[Criterion, ...]  # all must pass; empty: veto only
    veto_threshold: float | None = None


def parse_rejection(
    rollout_rs: str | None,
    threshold: float | str | None,
    threshold_lower: float | None,
    veto_threshold: float | None,
) -> RejectionSampling | None:
    """The criteria of verl's keys (see the module docstring); None when neither rejection nor veto is set.

    Raises RejectionSpecError naming the key for unknown options, missing or malformed thresholds, bounds that
    keep nothing (lower > upper), and keys of one spelling used with the other's options.
    """
    if veto_threshold is not None and veto_threshold <= 0:
        raise RejectionSpecError("rollout_token_veto_threshold", f"must be > 0, got {veto_threshold!r}")
    if rollout_rs is None:
        for key, value in (("rollout_rs_threshold", threshold), ("rollout_rs_threshold_lower", threshold_lower)):
            if value is not None:
                raise RejectionSpecError(key, f"={value!r} needs rollout_rs (null: no rejection sampling)")
        return None if veto_threshold is None else RejectionSampling((), veto_threshold)
    if threshold is None:
        raise RejectionSpecError("rollout_rs_threshold", f"is required with rollout_rs={rollout_rs!r}")
    if rollout_rs in RATIO_OPTIONS:
        criteria = (_ratio_criterion(rollout_rs, threshold, threshold_lower),)
    else:
        if threshold_lower is not None:
            raise RejectionSpecError("rollout_rs_threshold_lower", f"is only read with rollout_rs = token | sequence "
                                     f"| geometric (verl <= 0.7); for {rollout_rs!r} put the bounds in "
                                     "rollout_rs_threshold as lower_upper")
        criteria = _divergence_criteria(rollout_rs, threshold)
    return RejectionSampling(criteria, veto_threshold)


def _ratio_criterion(name: str, threshold: float | str, threshold_lower: float | None) -> Criterion:
    upper = _positive("rollout_rs_threshold", threshold, f"a number with rollout_rs={name!r}")
    lower = 1.0 / upper if threshold_lower is None else _positive("rollout_rs_threshold_lower", threshold_lower,
                                                                   "a number")
    if lower > upper:
        raise RejectionSpecError("rollout_rs_threshold_lower", f"{lower!r} is above rollout_rs_threshold={upper!r}: "
                                                               "every token would be rejected")
    return Criterion(name, "ratio", RATIO_OPTIONS[name], lower, upper)


def _divergence_criteria(rollout_rs: str, threshold: float | str) -> tuple[Criterion, ...]:
    names = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [n for n in names if n not in DIVERGENCE_OPTIONS]
    if not names or unknown:
        raise RejectionSpecError("rollout_rs", f"{rollout_rs!r}: expected one of {', '.join(RATIO_OPTIONS)} or a "
                                               f"comma list of {', '.join(DIVERGENCE_OPTIONS)}")
    specs = [threshold] if not isinstance(threshold, str) else [p.strip() for p in threshold.split(",") if p.strip()]
    if len(specs) not in (1, len(names)):
        raise RejectionSpecError("rollout_rs_threshold", f"{threshold!r} has {len(specs)} specs for {len(names)} "
                                                         f"rollout_rs options; give one, or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_divergence_criterion(name, spec) for name, spec in zip(names, specs))


def _divergence_criterion(name: str, spec: float | str) -> Criterion:
    level, estimator = name.rsplit("_", 1)
    key = "rollout_rs_threshold"
    if estimator != "k1":
        if isinstance(spec, str) and "_" in spec:
            raise RejectionSpecError(key, f"{spec!r}: {name} takes one upper bound, not lower_upper")
        return Criterion(name, estimator, _DIVERGENCE_REDUCTIONS[level], None, _positive(key, spec, "a number"))
    lower_spec, _, upper_spec = spec.partition("_") if isinstance(spec, str) and "_" in spec else (None, "", spec)
    upper = _positive(key, upper_spec, f"a number or lower_upper for {name}")
    lower = 1.0 / upper if lower_spec is None else _positive(key, lower_spec, f"a number or lower_upper for {name}")
    if lower > upper:
        raise RejectionSpecError(key, f"{spec!r}: lower bound above upper bound for {name}: everything is rejected")
    return Criterion(name, "k1", _DIVERGENCE_REDUCTIONS[level], math.log(lower), math.log(upper))


def _positive(key: str, value: float | str, expected: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise RejectionSpecError(key, f"{value!r}: expected {expected}") from None
    if not number > 0:
        raise RejectionSpecError(key, f"{value!r}: bounds must be > 0")
    return number


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rejection: RejectionSampling
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The kept tokens `[B, T]` (bool, a subset of the valid ones) and verl's metrics, whole-batch.

    log_ratio `[B, T]` is log pi_old - log pi_behav. Metrics: rollout_rs_masked_fraction (valid tokens rejected)
    and rollout_rs_seq_masked_fraction (sequences with a rejected token, of those with valid tokens); per criterion
    its statistic's mean (over valid tokens), max and min (over tokens, or sequences for per-sequence criteria) and
    the fractions above the upper / below the lower bound (see `Criterion.metric_prefix` for the names; the
    divergence criteria also report their own masked fractions); with the veto rollout_is_veto_fraction (sequences)
    and rollout_is_catastrophic_token_fraction (valid tokens).
    """
    valid = response_mask.bool()  # [B, T]
    log_ratio = torch.where(valid, log_ratio.detach(), 0.0)  # padding may hold inf/NaN
    passed = torch.ones_like(valid)  # [B, T]
    metrics: dict[str, torch.Tensor] = {}
    for criterion in rejection.criteria:
        statistic = _statistic(criterion, log_ratio, valid)  # [B, T] or [B]
        within = statistic <= criterion.upper
        if criterion.lower is not None:
            within &= statistic >= criterion.lower
        within = within if criterion.reduction == "token" else within[:, None].expand_as(valid)  # [B, T]
        metrics |= _statistic_metrics(criterion, statistic, valid)
        if criterion.estimator != "ratio":
            metrics |= _masked_fractions(f"rollout_rs_{criterion.name}", within, valid)
        passed &= within
    if rejection.criteria:
        metrics |= _masked_fractions("rollout_rs", passed, valid)
    kept = valid & passed
    if rejection.veto_threshold is not None:
        catastrophic = valid & (log_ratio < math.log(rejection.veto_threshold))  # [B, T]
        vetoed = catastrophic.any(dim=-1)  # [B]
        kept &= ~vetoed[:, None]
        metrics["rollout_is_veto_fraction"] = masked_mean(vetoed.float(), valid.any(dim=-1))
        metrics["rollout_is_catastrophic_token_fraction"] = masked_mean(catastrophic.float(), valid)
    return kept, metrics


def _statistic(criterion: Criterion, log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The criterion's statistic: `[B, T]` per token or `[B]` per sequence (0, or a ratio of 1, where no tokens)."""
    if criterion.estimator == "ratio":  # reduce log r, then exp: the ratio of the whole (or mean) sequence
        return _reduce(log_ratio, valid, criterion.reduction).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    clamped = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    per_token = {"k1": -clamped, "k2": 0.5 * clamped.square(), "k3": clamped.exp() - 1.0 - clamped}
    return _reduce(per_token[criterion.estimator], valid, criterion.reduction)


def _reduce(values: torch.Tensor, valid: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    if reduction == "token":
        return values
    if reduction == "sum":
        return masked_sum(values, valid, dim=-1)
    if reduction == "mean":
        return masked_mean(values, valid, dim=-1)
    largest = torch.where(valid, values, -math.inf).max(dim=-1).values  # [B]
    return torch.where(valid.any(dim=-1), largest, 0.0)


def _statistic_metrics(criterion: Criterion, statistic: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean over valid tokens; max, min and out-of-bound fractions over the units tested (tokens or sequences)."""
    per_token = statistic if criterion.reduction == "token" else statistic[:, None].expand_as(valid)
    units = valid if criterion.reduction == "token" else valid.any(dim=-1)
    prefix, fraction = criterion.metric_prefix, criterion.fraction_prefix
    metrics = {
        f"{prefix}_mean": masked_mean(per_token, valid),
        f"{prefix}_max": torch.where(units, statistic, -math.inf).max(),
        f"{prefix}_min": torch.where(units, statistic, math.inf).min(),
        f"{fraction}_high": masked_mean((statistic > criterion.upper).float(), units),
    }
    if criterion.lower is not None:
        metrics[f"{fraction}_low"] = masked_mean((statistic < criterion.lower).float(), units)
    return metrics


def _masked_fractions(prefix: str, passed: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    rejected = valid & ~passed  # [B, T]
    return {
        f"{prefix}_masked_fraction": masked_mean(rejected.float(), valid),
        f"{prefix}_seq_masked_fraction": masked_mean(rejected.any(dim=-1).float(), valid.any(dim=-1)),
    }
