"""The streaming rollouter of both async modes: a controller thread that keeps the rollout pool's engines busy
through short `stream` calls (new requests in, finished samples out) while the trainer pool trains.

It starts prompt groups (the `n` samples of a prompt travel together) in loader order while the staleness budget
allows (staleness.Budget: `window + extra` outstanding after each sync), hands finished groups to the trainer
(`take`: first finished first, or in start order for one-step-off) and stops between two calls when the trainer
pauses it for a weight sync. Each replica's engine is kept saturated by RolloutWorker.stream, which refills freed
slots from its own backlog; the rollouter only has to keep enough requests outstanding.

Threads and locks: the trainer's thread calls the methods of the first section below, the rollouter's thread runs
the second. What both touch (the groups, the budget, the pause handshake, the stats) is guarded by `cond`;
`replica_load` is the rollouter's thread's alone. The rollouter owns the prompt feed (prompt_feed.py) it starts groups
from: its thread reads groups from it, `take` retires those the trainer took or dropped, and the trainer reads the
feed's checkpoint state and epoch through the feed's methods (`feed.state_dict()`, `feed.epoch()`), never the loader.
The feed has its own lock, taken after `cond` where both are held.

Checkpoints (`checkpoint`, `restore`): a save first lets the requests in flight finish (a drain, as a sync without
partial rollout does) and waits for their scores, so what is in flight is only finished groups: the checkpoint keeps
them whole (samples, scores, versions) in take order, with the budget left and the drop count, and the feed's state
(which also re-reads the groups read ahead and not started). A resumed run takes exactly the groups, and starts
exactly the requests, of the run it continues. Keeping a half-generated sequence instead would change its later
log-probs: restarted, it is prefilled again rather than decoded on from its cache, at a point of the run that
depends on timing.

It also accounts where the rollout pool's time goes (`take_stats`): engine steps (prefill, decode, the decode batch
size), the call overhead around them (Ray, packing samples) and the time it stood idle between calls (budget spent,
paused for a sync).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

import torch

from shardrl.controller.group import RoleHandle
from shardrl.data.batch import Batch
from shardrl.rewards.manager import SampleScores
from shardrl.trainer.prompt_feed import PromptFeed
from shardrl.trainer.reward_loop import Scorer, ScoringThread, take_scored
from shardrl.trainer.staleness import Budget
from shardrl.trainer.tracking import Timeline
from shardrl.workers.rollout import RolloutWorker

STEPS_PER_CALL = 16  # engine steps per stream call: how long a pause request may wait for the rollouter
# what RolloutWorker.stream reports per call, summed over calls and replicas
ENGINE_KEYS = ("engine_s", "prefill_s", "decode_steps", "decode_rows", "prefill_tokens", "graph_capture_s",
               "tool_idle_s", "decode_steps_during_tools")


@dataclass
class Group:
    """The `n` sample rows of one prompt, from start to the trainer."""

    key: tuple[int, int]  # (loader batch, row): a step's groups train in this order, as the synchronous batch does
    rows: Batch  # n rows to generate, one request each
    done: list[Batch] = field(default_factory=list)
    samples: Batch | None = None  # the n finished samples, in row order
    oldest_version: int = 0  # of any of its tokens
    scored: tuple[Batch, SampleScores] | None = None  # scored while the rollouter goes on (a scorer given)
    queued: bool = False  # finished (and scored, with a scorer): in the queue for the trainer

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


@dataclass
class RolloutState:
    """What a checkpoint keeps of the rollouter (`Rollouter.checkpoint`): pickled whole into the trainer state."""

    feed: dict  # PromptFeed.state_dict()
    queue: list[Group]  # finished, not taken: in take order (first finished first)
    started: list[tuple[int, int]]  # the keys of `queue` in start order (`take` with `in_order`)
    budget: int  # groups it may still start before the next sync
    dropped: int  # samples dropped so far (`async/dropped_samples`)


class Rollouter:
    """Keeps the rollout pool busy within the staleness budget; thread-safe towards the trainer's calls."""

    def __init__(self, rollout: RoleHandle, feed: PromptFeed, budget: Budget, timeline: Timeline,
                 trainer_step: Callable[[], int], in_order: bool = False, score: Scorer | None = None,
                 stream: Callable[..., Any] = RolloutWorker.stream) -> None:
        """`score`: score each finished group on a scoring thread of its own before the trainer may take it
        (`reward_model.use_reward_loop`; the group's `scored`); None: the trainer scores what it takes. `stream`:
        the worker method the calls run, `RolloutWorker.stream` on a rollout pool or the colocated worker's."""
        self.rollout, self.stream, self.feed = rollout, stream, feed
        self.num_replicas = rollout.replicas(stream)
        self.group_size, self.window, self.extra, self.in_order = feed.group_size, budget.window, budget.extra, in_order
        self.timeline, self.trainer_step = timeline, trainer_step
        self.cond = threading.Condition()
        self.upcoming: deque[Group] = deque()  # read from the feed, not started
        self.outstanding: deque[Group] = deque()  # started, not taken by the trainer, in start order
        self.running: dict[str, Group] = {}  # by uid
        self.queue: deque[Group] = deque()  # finished, first finished first
        self.replica_load = [0] * self.num_replicas  # samples running per replica
        self.budget = budget.window + budget.extra  # groups it may still start before the next sync
        self.dropped = 0
        self.stats = dict.fromkeys(("call_s", *ENGINE_KEYS), 0.0)  # since `stats_since`
        self.stats_since = time.perf_counter()
        self.slots = 0  # an engine's sequence slots (max_num_seqs or fewer)
        # Pausing: the trainer asks (`requests` counts its asks), the thread answers between calls (`answered`).
        self.pausing = self.drain = self.stopping = False
        self.requests = self.answered = 0
        self.error: BaseException | None = None
        self.scoring_error: BaseException | None = None  # the scorer's (a reward function's), raised as it is
        self.thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
        self.scoring: ScoringThread | None = None
        self.being_scored: dict[str, Group] = {}  # by uid, finished and not yet scored
        if score is not None:
            self.scoring = ScoringThread(self._scoring_failed_on(score), timeline, trainer_step, self._scored)

    # ---- the trainer's side -----------------------------------------------------------------------------------------

    def take(self, num_groups: int, version: int, bound: int) -> tuple[list[Group], dict[str, float]]:
        """`num_groups` finished groups (waits for them) in key order: the first finished, or with `in_order` the
        first started. Groups with a token more than `bound` versions older than `version` are dropped (only
        possible with partial rollout, see staleness.py) and their budget returned."""
        with self.cond:
            while True:
                self._raise_error()
                for group in [g for g in self.queue if version - g.oldest_version > bound]:
                    self._remove(group)
                    self.dropped += len(group.rows)
                    self.budget += 1
                    self.cond.notify_all()
                if (groups := self._ready(num_groups)) is not None:
                    break
                self.cond.wait()
            for group in groups:
                self._remove(group)
            metrics = {"async/queue_groups": float(len(self.queue)), "async/running_groups": float(len(self.running)),
                       "async/dropped_samples": float(self.dropped)}
        return sorted(groups, key=lambda g: g.key), metrics

    def take_stats(self) -> dict[str, float]:
        """Where the rollout pool's time went since the last call (seconds, per replica): `rollout/engine_s` in
        engine steps, of which `rollout/prefill_s` prefill (re-prefills after a partial-rollout sync included);
        `rollout/overhead_s` in calls but not in engine steps (Ray, packing samples); `rollout/idle_s` between
        calls (budget spent, paused for a sync). `rollout/decode_batch`: sequences per decode step, of `slots`.
        `rollout/graph_capture_s`: of the engine time, capturing decode CUDA graphs (new batch shapes).
        Multi-turn: `rollout/tool_idle_s` with nothing to step because every trajectory waited on its tools (inside
        the calls), `rollout/decode_steps_during_tools` steps that ran while some trajectory waited (waits hidden)."""
        with self.cond:
            s, wall = self.stats, time.perf_counter() - self.stats_since
            self.stats, self.stats_since = dict.fromkeys(s, 0.0), time.perf_counter()
        engine = {k: s[k] / self.num_replicas for k in ENGINE_KEYS}
        decode_batch = engine["decode_rows"] / max(engine["decode_steps"], 1.0)
        return {"rollout/engine_s": engine["engine_s"], "rollout/prefill_s": engine["prefill_s"],
                "rollout/overhead_s": s["call_s"] - engine["engine_s"], "rollout/idle_s": wall - s["call_s"],
                "rollout/decode_steps": engine["decode_steps"], "rollout/decode_batch": decode_batch,
                "rollout/occupancy": decode_batch / max(self.slots, 1), "rollout/prefill_tokens":
                engine["prefill_tokens"], "rollout/graph_capture_s": engine["graph_capture_s"],
                "rollout/tool_idle_s": engine["tool_idle_s"],
                "rollout/decode_steps_during_tools": engine["decode_steps_during_tools"]}

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
                self.budget = self.window + self.extra - len(self.outstanding)
            self.pausing = False
            self.cond.notify_all()

    def checkpoint(self) -> RolloutState:
        """Pause (draining the requests in flight), wait for their scores and return what a checkpoint keeps; the
        caller resumes (`resume(new_window=False)`) once the checkpoint is written."""
        self.pause(drain=True)
        with self.cond:
            while self.being_scored:
                self._raise_error()
                self.cond.wait()
            queue = [replace(g, done=[]) for g in self.queue]  # finished: `samples` (or `scored`) hold them
            return RolloutState(self.feed.state_dict(), queue, [g.key for g in self.outstanding], self.budget,
                                self.dropped)

    def restore(self, state: RolloutState) -> None:
        """Before the thread starts: the groups, budget and drop count of a checkpoint, and the feed's state."""
        self.feed.load_state_dict(state.feed, held=[g.key for g in state.queue])
        by_key = {g.key: g for g in state.queue}
        self.queue.extend(state.queue)
        self.outstanding.extend(by_key[key] for key in state.started)
        self.budget, self.dropped = state.budget, state.dropped

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
        if self.scoring is not None:
            self.scoring.close()

    def _ready(self, num_groups: int) -> list[Group] | None:
        """The groups `take` hands out, once they are all finished."""
        candidates = list(islice(self.outstanding if self.in_order else self.queue, num_groups))
        if len(candidates) < num_groups or not all(g.queued for g in candidates):
            return None
        return candidates

    def _remove(self, group: Group) -> None:
        self.outstanding.remove(group)
        self.queue.remove(group)
        self.feed.retire([group.key])

    def _raise_error(self) -> None:
        if self.scoring_error is not None:
            raise self.scoring_error
        if self.error is not None:
            raise RuntimeError(f"the rollouter failed: {self.error}") from self.error

    # ---- the rollouter's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (new := self._next_groups()) is not None:
                start = time.perf_counter()
                with self.timeline.phase(self.trainer_step(), "generate", lane="rollout"):
                    results = self.rollout.call(self.stream, self._assign(new), [STEPS_PER_CALL] * self.num_replicas)
                with self.cond:
                    self.stats["call_s"] += time.perf_counter() - start
                    for replica, (finished, engine) in enumerate(results):
                        self._record(replica, finished)
                        for key in ENGINE_KEYS:
                            self.stats[key] += engine[key]
                        if replica == 0:  # multi-turn: the engine idle because every trajectory waited on tools
                            for begin, end in engine["tool_idle_spans"]:
                                self.timeline.add_wall_span(self.trainer_step(), "tool_idle", "rollout", begin, end)
                        self.slots = engine["slots"]
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
                self.upcoming.extend(Group(key, rows) for key, rows in self.feed.read())
            new.append(self.upcoming.popleft())
        self.budget -= len(new)
        self.running.update((g.rows.non_tensors["uid"][0], g) for g in new)
        self.outstanding.extend(new)
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

    def _record(self, replica: int, finished: Batch | None) -> None:
        if finished is None:
            return
        self.replica_load[replica] -= len(finished)
        for row, uid in enumerate(finished.non_tensors["uid"]):
            if not self.running[uid].add(finished.take([row])):
                continue
            group = self.running.pop(uid)
            if self.scoring is None:
                self._enqueue(group)
            else:
                self.being_scored[uid] = group
                self.scoring.submit(group.samples)

    def _enqueue(self, group: Group) -> None:
        group.queued = True
        self.queue.append(group)

    # ---- the scoring thread -----------------------------------------------------------------------------------

    def _scored(self, batch: Batch, scores: SampleScores) -> None:
        """The groups of one scoring call (any number of whole groups), each to the queue with its own rows."""
        uids = batch.non_tensors["uid"]
        with self.cond:
            for uid in dict.fromkeys(uids):
                group = self.being_scored.pop(uid)
                group.scored = take_scored(batch, scores, torch.tensor([i for i, u in enumerate(uids) if u == uid]))
                self._enqueue(group)
            self.cond.notify_all()

    def _scoring_failed_on(self, score: Scorer) -> Scorer:
        """`score`, handing its error to the trainer's thread (which waits in `take`) as the rollouter's own."""
        def scored(samples: Batch) -> tuple[Batch, SampleScores]:
            try:
                return score(samples)
            except BaseException as error:
                with self.cond:
                    self.scoring_error = error
                    self.cond.notify_all()
                raise
        return scored
