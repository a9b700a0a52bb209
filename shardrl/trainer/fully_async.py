"""Fully asynchronous PPO: a rollouter streams samples into a bounded queue, the trainer takes them a step at a time.

The rollouter (rollouter.py) is a controller thread that keeps the rollout pool's engines saturated through short
`stream` calls, so the pool generates while the trainer pool trains. The trainer takes `require_batches x
ppo_mini_batch_size` prompt groups per step (the `n` samples of a prompt travel together, first finished first
taken), scored as each one finished (`reward_model.use_reward_loop`: on the rollouter's scoring thread, else by
`PPOTrainer.score` after taking them), and runs `.train` on them; every `trigger_parameter_sync_step` steps it
pauses the rollouter at a call boundary and syncs. How far generation may run ahead, and so how stale samples may
be, is the budget rule of staleness.py: after each sync the rollouter may start prompts until `window + extra` are
outstanding.
Without `partial_rollout` the pause lets running requests finish first (every sample is then one version); with it
they are paused in the engine and continue under the new weights (their tokens carry both versions).

One-step-off (one_step_off.py) is this schedule with a batch per step, a sync every step, one batch of run-ahead and
the batches taken whole, in loader order.

Prompts and checkpoints: when the schedule starts, the trainer hands its loader to a prompt feed (prompt_feed.py)
that the rollouter owns and reads on its thread; from then on the trainer asks the feed (its own lock) for the epoch
and never touches the loader. A save pauses the rollouter with its requests finished (`Rollouter.checkpoint`) and
keeps the finished groups not yet trained (samples, scores, versions), the budget and the feed's position (the
start of the oldest loader batch with a group not trained, and which groups read ahead were not started). It also
syncs the rollout when the save falls between two syncs, so the rollout holds the saved weights, the only ones a
resumed run has. A resumed run so takes the same groups and starts the same requests as the run it continues: on
CPU its metrics equal an uninterrupted run's bit for bit, where that run is itself reproducible (no partial
rollout: where a partial-rollout sync cuts a running request depends on timing).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardrl.data.batch import Batch
from shardrl.trainer import batch_ops, staleness
from shardrl.trainer.ppo import PPOTrainer
from shardrl.trainer.prompt_feed import PromptFeed
from shardrl.trainer.reward_loop import Scorer, concat_scored
from shardrl.trainer.rollouter import Rollouter, RolloutState

IDLE_PHASES = ("wait_rollout", "pause_rollout")  # the trainer's phases that wait for the rollouter


class FullyAsyncTrainer(PPOTrainer):
    rollouter: Rollouter | None = None
    in_order = False  # take groups first finished first (fully async) or whole batches in loader order
    restored: dict[str, Any] | None = None  # a checkpoint's schedule state, for the rollouter the schedule builds

    def partial_rollout(self) -> bool:
        """Whether a sync pauses the requests in flight (continued under the new weights) instead of draining."""
        return self.plan.async_training.partial_rollout

    def schedule(self) -> Iterator[dict[str, Any]]:
        budget = staleness.budget(self.plan)
        # Batch k trains at step k unless an async checkpoint says otherwise; the feed owns the loader from now on.
        feed = PromptFeed(self.loader, self.sample_rows, self.loop.samples_per_prompt, self.global_step)
        scorer = self.score_samples if self.plan.reward.while_generating else None
        self.rollouter = self.make_rollouter(feed, budget, scorer)
        if self.restored is not None and "rollouter" in self.restored:  # an async checkpoint
            self.rollouter.restore(self.restored["rollouter"])
        elif self.restored is not None:  # a synchronous one: nothing was in flight
            feed.load_state_dict(self.restored["dataloader"])
        self.rollouter.thread.start()
        try:
            while True:
                step, t = self.global_step, self.timeline
                with t.phase(step, "step"):
                    with t.phase(step, "wait_rollout"):
                        groups, metrics = self.rollouter.take(budget.per_step, self.policy_version,
                                                              self.max_staleness)
                    if self.rollouter.scoring is not None:  # scored as each group finished
                        batch, scores = concat_scored([g.scored for g in groups])
                    else:
                        batch, scores = self.score(Batch.concat([g.samples for g in groups]), step)
                    batch, train_metrics = self.train(batch, step)
                    metrics |= batch_ops.reward_metrics(scores.extras) | train_metrics
                    if (step + 1) % budget.trigger == 0:
                        metrics |= self._sync_paused(step)
                metrics["timing_s/rollout_overlap"] = t.overlap(step, "rollout", IDLE_PHASES)
                yield metrics | self.rollouter.take_stats() | self.step_metrics(batch, step)
        finally:
            self.rollouter.close()
            self.rollouter = None

    def make_rollouter(self, feed: PromptFeed, budget: staleness.Budget, scorer: Scorer | None) -> Rollouter:
        """The rollouter on the rollout pool (the colocated schedule's runs on the trainer pool)."""
        return Rollouter(self.workers.rollout, feed, budget, self.timeline, lambda: self.global_step, self.in_order,
                         scorer)

    def _sync_paused(self, step: int) -> dict[str, float]:
        with self.timeline.phase(step, "pause_rollout"):
            self.rollouter.pause(drain=not self.partial_rollout())
        try:
            return self.sync_weights(step)
        finally:
            self.rollouter.resume(new_window=True)

    def validate(self) -> dict[str, float]:
        """On the rollout pool's current weights, between two of the rollouter's calls."""
        if self.rollouter is None:
            return super().validate()
        self.rollouter.pause(drain=not self.partial_rollout())
        try:
            return super().validate()
        finally:
            self.rollouter.resume(new_window=False)

    def save(self) -> None:
        """The checkpoint with what is in flight (`schedule_state`, which pauses the rollouter), then go on."""
        try:
            super().save()
        finally:
            if self.rollouter is not None:
                self.rollouter.resume(new_window=False)

    def schedule_state(self) -> dict[str, Any]:
        """The rollouter's state, paused with its requests finished; the rollout synced to the weights saved."""
        if self.rollouter is None:
            return super().schedule_state()
        state: RolloutState = self.rollouter.checkpoint()
        self.sync_weights(self.global_step)  # a no-op on a sync step
        return {"rollouter": state}

    def restore_schedule(self, state: dict[str, Any]) -> None:
        """Kept for the rollouter the schedule builds (an async checkpoint's state or a synchronous one's)."""
        self.restored = state

    def epoch(self) -> int:
        if self.rollouter is None:
            return super().epoch()
        return self.rollouter.feed.epoch()
