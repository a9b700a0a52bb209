"""Colocated asynchronous PPO (verl 0.9's `trainer.v1.trainer_mode=colocate_async`): the rollout engine shares the
trainer pool's GPUs, as in the synchronous schedule, but generation runs ahead of the step and is never waited out.

The rollouter (rollouter.py) streams prompt groups through the colocated engine (`ActorRolloutRefWorker.stream`),
keeping `num_warmup_batches` loader batches beyond the current one in flight. A step takes the first
`data.train_batch_size` prompt groups to finish, then pauses the stream: the requests still running stop with
what they generated (and with `rollout.free_cache_engine` the KV cache is freed for training), the step trains, the
new weights go to the engine, and the stopped requests continue under them (partial rollout: their later tokens
carry the new version) beside the next batch's. So the engine's slots freed by short responses fill with the next
batch's prompts instead of idling through the longest response of each batch: a step waits for a batch's worth of
finished groups, not for the slowest of the groups it started.

Staleness is verl's rule: a group whose generation spans more than `trainer.v1.sampler.max_off_policy_threshold`
policy versions (a token more than threshold - 1 versions older than the trainer's) is dropped when the trainer would
take it (`async/dropped_samples`), and another prompt is started in its place. With `num_warmup_batches=0` nothing
runs ahead and the schedule is the synchronous one.

Everything else the trainer runs on the trainer pool (validation, checkpoints) happens with the stream paused, so
the rollouter's calls and the trainer's never interleave on a rank.
"""

from __future__ import annotations

from typing import Any

from shardrl.data.batch import Batch
from shardrl.trainer import staleness
from shardrl.trainer.fully_async import FullyAsyncTrainer
from shardrl.trainer.prompt_feed import PromptFeed
from shardrl.trainer.reward_loop import Scorer
from shardrl.trainer.rollouter import Rollouter
from shardrl.workers.hybrid import ActorRolloutRefWorker


class ColocatedAsyncTrainer(FullyAsyncTrainer):
    def partial_rollout(self) -> bool:
        return True

    def make_rollouter(self, feed: PromptFeed, budget: staleness.Budget, scorer: Scorer | None) -> Rollouter:
        return Rollouter(self.workers.actor, feed, budget, self.timeline, lambda: self.global_step, self.in_order,
                         scorer, stream=ActorRolloutRefWorker.stream)

    def train(self, batch: Batch, step: int) -> tuple[Batch, dict[str, Any]]:
        """The step's training with the stream paused and its requests stopped; then the new weights go to the
        engine (the schedule's sync every step) and the stopped requests continue under them."""
        with self.timeline.phase(step, "pause_rollout"):
            self._pause_generation()
        try:
            batch, metrics = super().train(batch, step)
            metrics |= self.sync_weights(step)
        finally:
            self._resume_generation(new_window=True)
        return batch, metrics

    def _sync_paused(self, step: int) -> dict[str, float]:
        return {}  # `train` has synced

    def validate(self) -> dict[str, float]:
        if self.rollouter is None:
            return super().validate()
        self._pause_generation()
        try:
            return super(FullyAsyncTrainer, self).validate()
        finally:
            self._resume_generation(new_window=False)

    def _pause_generation(self) -> None:
        self.rollouter.pause(drain=False)
        self.workers.actor.call(ActorRolloutRefWorker.pause_generation)

    def _resume_generation(self, new_window: bool) -> None:
        self.workers.actor.call(ActorRolloutRefWorker.resume_generation)
        self.rollouter.resume(new_window)
