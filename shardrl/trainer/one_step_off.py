"""One-step-off-policy PPO: the synchronous step with generation moved one step ahead, onto the rollout pool.

While the trainer pool trains on batch k, the rollout pool generates batch k+1 with the weights of step k-1's update;
batch 0 is on-policy. By default (`async_training.partial_rollout` unset or false, verl's schedule) the weights of
step k's update are synced once batch k+1 has finished generating, so every sample comes from one version and is
exactly one version old. With `partial_rollout=true` the sync happens as soon as the update is done: batch k+1's
requests still running are paused and continue under the new weights (those tokens are on-policy when batch k+1
trains) and batch k+2 starts at once, so the engine refills the slots that batch k+1's long responses leave free
instead of idling through its tail; tokens are still at most one version old. Either way this is fully async's
schedule (fully_async.py) with a batch per step, a sync every step, one batch of run-ahead (staleness.budget) and
batches taken whole, in loader order; the step's verbs are `PPOTrainer`'s.
"""

from __future__ import annotations

from shardrl.trainer.fully_async import FullyAsyncTrainer


class OneStepOffTrainer(FullyAsyncTrainer):
    in_order = True

    def partial_rollout(self) -> bool:
        return bool(self.plan.async_training.partial_rollout)
