"""How old the trainer's samples may be (from the flags) and how old they were (from the samples).

Versions. The actor's initial weights are version 0 and its weights after the update of step k are version k + 1;
a sync hands the rollout engine the actor's current version, and the engine stamps every sampled token with the
version it held (`policy_versions`, the off-policy contract of DESIGN.md). A token's *lag* is the version the trainer
holds when it trains on the token minus the token's version: 0 is on-policy.

The bound per mode (`max_staleness`):

* sync: 0. Each step generates with the weights it then updates.
* one_step_off: 1. Batch k+1 starts once step k-1's update is synced and generates while step k trains. Without
  partial rollout the next sync (step k's update) waits for it to finish, so its tokens lag exactly 1 when step k+1
  trains on them; with partial rollout its requests still running at that sync continue under the new weights, so
  they lag 1 or 0: fully_async's rule with a batch per step, a sync every step and one batch of run-ahead
  (`budget`).
* fully_async: `trigger - 1 + ceil(extra / per_step)`. A sync window is `trigger = trigger_parameter_sync_step`
  steps of `per_step = require_batches x ppo_mini_batch_size` prompts, i.e. `window = trigger x per_step` prompts.
  After each sync the rollouter may start prompts until `window + extra` prompts, `extra = floor(staleness_threshold
  x window)`, are outstanding (queued or in flight), then pauses until the next sync (verl's rule). The trainer takes
  prompts first in, first out, so a prompt started at version v is trained at step v + trigger - 1 at the latest
  when it is among the window's first `window` prompts, and otherwise among the first `extra` of the next window.
  Without partial rollout, samples still running at a sync are finished before it, so this is a bound. With partial
  rollout they are paused and resumed after it and may be overtaken by newer ones; the trainer then drops any sample
  whose oldest token is past the bound (`async/dropped_samples`), so the bound holds in every mode.
  staleness_threshold=0 and trigger_parameter_sync_step=1 is the synchronous schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardrl.job.plan import JobPlan


@dataclass(frozen=True)
class Budget:
    """The streaming rollouter's rule in both async modes: a step trains `per_step` prompts, a sync follows every
    `trigger` steps, and after each sync the rollouter may have `window + extra` prompts outstanding."""

    per_step: int
    trigger: int
    window: int  # trigger x per_step: the prompts the trainer takes between two syncs
    extra: int  # how many it may start beyond them


def budget(plan: JobPlan) -> Budget:
    """fully_async: the flags above. one_step_off: a batch per step, a sync every step and one batch of run-ahead
    (the next batch generates while the current one trains), which is a bound of 1. colocate_async: a batch per step,
    a sync every step and `warmup_batches` batches of run-ahead."""
    a = plan.async_training
    if plan.mode in ("one_step_off", "colocate_async"):
        per_step = plan.loop.train_batch_size
        return Budget(per_step, 1, per_step, per_step * (a.warmup_batches if plan.mode == "colocate_async" else 1))
    per_step = a.require_batches * plan.loop.actor_mini_batch_size
    window = a.trigger_parameter_sync_step * per_step
    return Budget(per_step, a.trigger_parameter_sync_step, window, math.floor(a.staleness_threshold * window))


def max_staleness(plan: JobPlan) -> int:
    """The largest lag (versions) a trained token can have under the plan's schedule; see the module docstring."""
    if plan.mode == "sync":
        return 0
    if plan.mode == "colocate_async":  # verl's rule: a group spanning more versions is dropped, whatever the budget
        return plan.async_training.max_lag
    b = budget(plan)
    return b.trigger - 1 + math.ceil(b.extra / b.per_step)


def describe(plan: JobPlan) -> str:
    """The line the trainer prints at start."""
    bound = max_staleness(plan)
    return (f"{plan.mode} mode: samples may be up to {bound} version{'s' if bound != 1 else ''} old "
            f"(a token's lag = trainer version - the version that sampled it)")


def lag_metrics(versions: torch.Tensor, mask: torch.Tensor, version: int, bound: int) -> dict[str, float | list]:
    """Lag statistics of one training batch: `versions` [B, R] (-1 on padding), `mask` [B, R] the response tokens,
    `version` the trainer's. `async/staleness_hist` is the fraction of tokens per lag 0.. (a list, for metrics.jsonl);
    `async/lag_<k>_frac` the same as scalars for k = 0..`bound`. Samples without response tokens count as lag 0."""
    lags = version - versions[mask.bool()]  # [num tokens]
    if lags.numel() == 0:
        return {}
    if lags.min() < 0:
        raise ValueError(f"policy_versions up to {int(versions.max())} are newer than the trainer's version {version}: "
                         "the rollout was synced with weights the trainer does not have")
    counts = torch.bincount(lags, minlength=bound + 1).double()
    fractions = (counts / lags.numel()).tolist()
    valid = mask.bool()
    oldest = versions.masked_fill(~valid, version).amin(-1)  # [B]
    newest = versions.masked_fill(~valid, -1).amax(-1)  # [B]
    metrics: dict[str, float | list] = {
        "async/staleness_mean": float(lags.double().mean()),
        "async/staleness_max": float(lags.max()),
        "async/sample_staleness_mean": float((version - oldest).double().mean()),
        # samples continued across a sync (partial rollout): tokens of more than one version
        "async/mixed_version_frac": float((newest > oldest).double().mean()),
        "async/staleness_hist": fractions,
    }
    metrics |= {f"async/lag_{k}_frac": fractions[k] for k in range(bound + 1)}
    return metrics
