"""One-step-off-policy PPO: the synchronous step with generation moved one step ahead, onto the rollout pool.

While the trainer pool trains on batch k, the rollout pool generates batch k+1, which it started with the weights of
step k-1's update; batch 0 is on-policy. The weights of step k's update are synced as soon as it is done, without
waiting for batch k+1: its requests still running are paused, continue under the new weights (partial rollout:
those tokens are on-policy when batch k+1 trains) and batch k+2 starts at once, so the rollout engine refills the
slots that batch k+1's long responses leave free instead of idling through its tail. Every token is at most one
version old. This is fully async's schedule (fully_async.py) with a batch per step, a sync every step, one batch of
run-ahead (staleness.budget) and batches taken whole, in loader order; the step's verbs are `PPOTrainer`'s.
"""

from __future__ import annotations

from shardrl.trainer.fully_async import FullyAsyncTrainer


class OneStepOffTrainer(FullyAsyncTrainer):
    in_order = True

    def partial_rollout(self) -> bool:
        return True
