"""Fully asynchronous PPO: a rollouter streams samples into a bounded queue, the trainer takes them a step at a time.

The rollouter (rollouter.py) is a controller thread that keeps the rollout pool's engines saturated through short
`stream` calls, so the pool generates while the trainer pool trains. The trainer takes `require_batches x
ppo_mini_batch_size` prompt groups per step (the `n` samples of a prompt travel together, first finished first
taken) and runs `PPOTrainer.score` and `.train` on them; every `trigger_parameter_sync_step` steps it pauses the
rollouter at a call boundary and syncs. How far generation may run ahead, and so how stale samples may be, is the
budget rule of staleness.py: after each sync the rollouter may start prompts until `window + extra` are outstanding.
Without `partial_rollout` the pause lets running requests finish first (every sample is then one version); with it
they are paused in the engine and continue under the new weights (their tokens carry both versions).

One-step-off (one_step_off.py) is this schedule with a batch per step, a sync every step, one batch of run-ahead and
the batches taken whole, in loader order.

Checkpoints: the rollouter reads prompts ahead of the trainer, so the loader's own position would skip the prompts
queued or generating at a save. The saved position is instead the start of the oldest loader batch with a group not
yet trained, with the keys (loader batch, row) of every such group; a resumed run generates exactly those groups
again (under the checkpoint's weights, with their original sampling seeds) before reading on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardrl.data.batch import Batch
from shardrl.trainer import batch_ops, staleness
from shardrl.trainer.ppo import PPOTrainer
from shardrl.trainer.rollouter import Rollouter

IDLE_PHASES = ("wait_rollout", "pause_rollout")  # the trainer's phases that wait for the rollouter


class FullyAsyncTrainer(PPOTrainer):
    rollouter: Rollouter | None = None
    in_order = False  # take groups first finished first (fully async) or whole batches in loader order
    # The loader's state before each loader batch the rollouter may still need (by batch index), the index of the
    # next batch to read, and after a resume the groups to generate again: {batch index: rows}.
    batch_starts: dict[int, dict[str, int]]
    next_batch: int | None = None
    resumed_groups: dict[int, set[int]] | None = None

    def partial_rollout(self) -> bool:
        """Whether a sync pauses the requests in flight (continued under the new weights) instead of draining."""
        return self.config.async_training.partial_rollout

    def schedule(self) -> Iterator[dict[str, Any]]:
        budget = staleness.budget(self.config)
        self.batch_starts = {}
        if self.next_batch is None:  # not resumed from an async checkpoint: batch k trains at step k
            self.next_batch = self.global_step
        self.rollouter = Rollouter(self.workers.rollout, self.workers.rollout.layout.dp, self._sample_batches(),
                                   self.config.actor_rollout_ref.rollout.n, budget, self.timeline,
                                   lambda: self.global_step, self.in_order)
        self.rollouter.thread.start()
        try:
            while True:
                step, t = self.global_step, self.timeline
                with t.phase(step, "step"):
                    with t.phase(step, "wait_rollout"):
                        groups, metrics = self.rollouter.take(budget.per_step, self.policy_version,
                                                              self.max_staleness)
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

    def loader_state(self) -> dict[str, Any]:
        """The start of the oldest loader batch with a group not yet trained, and the keys of all such groups (see
        the module docstring); read under the rollouter's lock, so no batch is read meanwhile."""
        if self.rollouter is None:
            return super().loader_state()
        with self.rollouter.cond:
            pending = self.rollouter.pending_keys()
            first = pending[0][0] if pending else self.next_batch
            loader = self.batch_starts[first] if pending else self.loader.state_dict()
            for k in [k for k in self.batch_starts if k < first]:  # no longer needed by any checkpoint; under the
                del self.batch_starts[k]  # lock, as the rollouter's thread adds batches to it
        return {"loader": loader, "first_batch": first, "pending": [list(key) for key in pending]}

    def restore_loader(self, state: dict[str, Any]) -> None:
        """A fully async checkpoint's state (a synchronous one's is the loader's own: nothing was in flight)."""
        if "first_batch" not in state:
            super().restore_loader(state)
            return
        self.loader.load_state_dict(state["loader"])
        self.next_batch = state["first_batch"]
        self.resumed_groups = {}
        for k, row in state["pending"]:
            self.resumed_groups.setdefault(k, set()).add(row)

    def _sample_batches(self) -> Iterator[tuple[int, Batch, list[int]]]:
        """(k, the sample rows of the k-th loader batch seeded as the synchronous step k seeds its batch, the rows
        of its groups to start). After a resume the batches up to the last one with a pending group yield only
        those groups; the others all of theirs."""
        k, resumed = self.next_batch, self.resumed_groups or {}
        last_resumed = max(resumed, default=-1)
        batches = self.prompt_batches()
        while True:
            self.batch_starts[k] = self.loader.state_dict()
            samples = self.sample_rows(next(batches), k)
            self.next_batch = k + 1
            rows = sorted(resumed.get(k, ())) if k <= last_resumed else list(
                range(len(samples) // self.config.actor_rollout_ref.rollout.n))
            if rows:
                yield k, samples, rows
            k += 1
