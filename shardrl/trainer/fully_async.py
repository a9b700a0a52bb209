"""Fully asynchronous PPO: a rollouter streams samples into a bounded queue, the trainer takes them a step at a time.

The rollouter is a controller thread that drives the rollout pool's engines through short `stream` calls (new
requests in, finished samples out), so the pool generates while the trainer pool trains. The trainer takes
`require_batches x ppo_mini_batch_size` prompt groups per step (the `n` samples of a prompt travel together, first
finished first taken) and runs `PPOTrainer.train` on them; every `trigger_parameter_sync_step` steps it pauses the
rollouter at a call boundary and syncs. How far generation may run ahead, and so how stale samples may be, is the
budget rule of staleness.py: after each sync the rollouter may start prompts until `window + extra` are outstanding.
Without `partial_rollout` the pause lets running requests finish first (every sample is then one version); with it
they are paused in the engine and continue under the new weights (their tokens carry both versions).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardrl.controller.group import RoleHandle
from shardrl.data.batch import Batch
from shardrl.trainer import staleness
from shardrl.trainer.ppo import PPOTrainer
from shardrl.trainer.tracking import Timeline

STEPS_PER_CALL = 16  # engine steps per stream call: how long a pause request may wait for the rollouter
IDLE_PHASES = ("wait_rollout", "pause_rollout")  # the trainer's phases that wait for the rollouter


@dataclass
class Group:
    """The `n` sample rows of one prompt, from start to the trainer."""

    key: tuple[int, int]  # (loader batch, row): a step's groups train in this order, as the synchronous batch does
    rows: Batch  # n rows to generate, one request each
    done: list[Batch] = field(default_factory=list)
    samples: Batch | None = None  # the n finished samples, in row order
    oldest_version: int = 0  # of any of its tokens

    def add(self, sample: Batch) -> bool:
        """Record one finished sample; True when the group is complete."""
        self.done.append(sample)
        if sum(len(s) for s in self.done) < len(self.rows):
            return False
        samples = Batch.concat(self.done)
        self.samples = samples.take(torch.argsort(samples.tensors["sample_seed"]))
        versions = self.samples.tensors["policy_versions"]  # [n, R], -1 on padding
        self.oldest_version = int(versions[self.samples.tensors["response_mask"].bool()].min())
        return True


class Rollouter:
    """Keeps the rollout pool busy within the staleness budget; thread-safe towards the trainer's calls."""

    def __init__(self, rollout: RoleHandle, num_replicas: int, sample_batches: Iterator[tuple[int, Batch]],
                 group_size: int, window: int, extra: int, timeline: Timeline, trainer_step) -> None:
        self.rollout, self.num_replicas, self.sample_batches = rollout, num_replicas, sample_batches
        self.group_size, self.window, self.extra = group_size, window, extra
        self.timeline, self.trainer_step = timeline, trainer_step
        self.cond = threading.Condition()
        self.upcoming: deque[Group] = deque()  # taken from the loader, not started
        self.running: dict[str, Group] = {}  # by uid
        self.queue: deque[Group] = deque()  # finished, oldest first
        self.replica_load = [0] * num_replicas  # samples running per replica
        self.budget = window + extra  # groups it may still start before the next sync
        self.dropped = 0
        # Pausing: the trainer asks (`requests` counts its asks), the thread answers between calls (`answered`).
        self.pausing = self.drain = self.stopping = False
        self.requests = self.answered = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rollouter", daemon=True)

    # ---- the trainer's side -----------------------------------------------------------------------------------------

    def take(self, num_groups: int, version: int, bound: int) -> tuple[list[Group], dict[str, float]]:
        """The first `num_groups` finished groups (waits for them), in key order. Groups with a token more than
        `bound` versions older than `version` are dropped (only possible with partial rollout, see staleness.py)
        and their budget returned."""
        with self.cond:
            while True:
                self._raise_error()
                for group in [g for g in self.queue if version - g.oldest_version > bound]:
                    self.queue.remove(group)
                    self.dropped += len(group.rows)
                    self.budget += 1
                    self.cond.notify_all()
                if len(self.queue) >= num_groups:
                    break
                self.cond.wait()
            groups = sorted((self.queue.popleft() for _ in range(num_groups)), key=lambda g: g.key)
            metrics = {"async/queue_groups": float(len(self.queue)), "async/running_groups": float(len(self.running)),
                       "async/dropped_samples": float(self.dropped)}
        return groups, metrics

    def pause(self, drain: bool) -> None:
        """Wait until the rollouter stands between two calls (with `drain`: with no request running)."""
        with self.cond:
            self.pausing, self.drain = True, drain
            self.requests += 1
            self.cond.notify_all()
            while self.answered != self.requests:
                self._raise_error()
                self.cond.wait()

    def resume(self, new_window: bool) -> None:
        """Let the rollouter go on; `new_window` (after a sync): the budget becomes `window + extra` outstanding."""
        with self.cond:
            if new_window:
                self.budget = self.window + self.extra - len(self.queue) - len(self.running)
            self.pausing = False
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the rollouter failed: {self.error}") from self.error

    # ---- the rollouter's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (new := self._next_groups()) is not None:
                step = self.trainer_step()
                with self.timeline.phase(step, "generate", lane="rollout"):
                    finished = self.rollout.stream(self._assign(new), [STEPS_PER_CALL] * self.num_replicas)
                with self.cond:
                    self._record(finished)
                    self.cond.notify_all()
        except BaseException as error:  # handed to the trainer's thread, which raises it
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _next_groups(self) -> list[Group] | None:
        """Groups to start with the next call (maybe none, when requests are running); None: stop."""
        with self.cond:
            while not self.stopping:
                if self.pausing and self.answered != self.requests:
                    if self.drain and self.running:
                        return []  # finish the running requests first, start nothing
                    self.answered = self.requests
                    self.cond.notify_all()
                if self.pausing:
                    self.cond.wait()  # paused: until resumed (or asked again)
                    continue
                new = self._start(self.budget)
                if new or self.running:
                    return new
                self.cond.wait()  # the budget is spent and nothing runs: wait for the next sync
            return None

    def _start(self, count: int) -> list[Group]:
        new = []
        while len(new) < count:
            if not self.upcoming:
                k, samples = next(self.sample_batches)
                n = self.group_size
                self.upcoming.extend(Group((k, row), samples.take(range(row * n, (row + 1) * n)))
                                     for row in range(len(samples) // n))
            new.append(self.upcoming.popleft())
        self.budget -= len(new)
        self.running.update((g.rows.non_tensors["uid"][0], g) for g in new)
        return new

    def _assign(self, groups: list[Group]) -> list[Batch | None]:
        """New groups to replicas in contiguous runs (as DP_COMPUTE splits a batch): in replica order, each filled
        up to an even share of all the samples that will be running."""
        loads = list(self.replica_load)
        share = -(-(sum(loads) + self.group_size * len(groups)) // self.num_replicas)
        per_replica: list[list[Batch]] = [[] for _ in range(self.num_replicas)]
        replica = 0
        for group in groups:
            while loads[replica] + self.group_size > share and replica < self.num_replicas - 1:
                replica += 1
            per_replica[replica].append(group.rows)
            loads[replica] += self.group_size
        self.replica_load = loads
        return [Batch.concat(rows) if rows else None for rows in per_replica]

    def _record(self, finished: list[Batch | None]) -> None:
        for replica, samples in enumerate(finished):
            if samples is None:
                continue
            self.replica_load[replica] -= len(samples)
            for row, uid in enumerate(samples.non_tensors["uid"]):
                if self.running[uid].add(samples.take([row])):
                    self.queue.append(self.running.pop(uid))


class FullyAsyncTrainer(PPOTrainer):
    rollouter: Rollouter | None = None

    def schedule(self) -> Iterator[dict[str, Any]]:
        a = self.config.async_training
        per_step = a.require_batches * self.config.actor_rollout_ref.actor.ppo_mini_batch_size
        window, extra = staleness.fully_async_window(self.config)
        self.rollouter = Rollouter(self.workers.rollout, self.workers.rollout.layout.dp, self._sample_batches(),
                                   self.config.actor_rollout_ref.rollout.n, window, extra, self.timeline,
                                   lambda: self.global_step)
        self.rollouter.thread.start()
        try:
            while True:
                step, t = self.global_step, self.timeline
                with t.phase(step, "step"):
                    with t.phase(step, "wait_rollout"):
                        groups, metrics = self.rollouter.take(per_step, self.policy_version, self.max_staleness)
                    batch, train_metrics = self.train(Batch.concat([g.samples for g in groups]), step)
                    metrics |= train_metrics
                    if (step + 1) % a.trigger_parameter_sync_step == 0:
                        metrics |= self._sync_paused(step)
                metrics["timing_s/rollout_overlap"] = t.overlap(step, "rollout", IDLE_PHASES)
                yield metrics | self.step_metrics(batch, step)
        finally:
            self.rollouter.close()
            self.rollouter = None

    def _sync_paused(self, step: int) -> dict[str, float]:
        with self.timeline.phase(step, "pause_rollout"):
            self.rollouter.pause(drain=not self.config.async_training.partial_rollout)
        try:
            return self.sync_weights(step)
        finally:
            self.rollouter.resume(new_window=True)

    def validate(self) -> dict[str, float]:
        """On the rollout pool's current weights, between two of the rollouter's calls."""
        if self.rollouter is None:
            return super().validate()
        self.rollouter.pause(drain=not self.config.async_training.partial_rollout)
        try:
            return super().validate()
        finally:
            self.rollouter.resume(new_window=False)

    def _sample_batches(self) -> Iterator[tuple[int, Batch]]:
        """(k, the sample rows of the k-th loader batch), seeded as the synchronous step k seeds its batch."""
        for k, prompts in enumerate(self.prompt_batches(), start=self.global_step):
            yield k, self.sample_rows(prompts, k)
