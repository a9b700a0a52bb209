"""The fully async rollouter's rules without Ray or models: a stand-in rollout role whose replicas generate one token
per request and engine step, stamped with the version they hold, and finish a request when a rule says so.

The budget (window + extra prompts outstanding after a sync), the staleness bound of staleness.py (reached, never
exceeded), pausing with and without draining (partial rollout), first-in-first-out groups trained in key order, and
dropping stale groups with their budget returned."""

import itertools
import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from shardrl.data.batch import Batch, as_object_array
from shardrl.trainer.fully_async import Rollouter
from shardrl.trainer.tracking import Timeline

N, PROMPTS_PER_BATCH = 2, 3


class FakeRollout:
    """`stream` as RolloutWorker's, per replica: queue the new rows, run `steps` steps, return what finished (a
request is finished when `done(its token versions)`)."""

    def __init__(self, num_replicas: int, done: Callable[[list[int]], bool]) -> None:
        self.layout = SimpleNamespace(dp=num_replicas)
        self.done, self.version = done, 0
        self.running: list[list[tuple[Batch, list[int]]]] = [[] for _ in range(num_replicas)]
        self.new_rows_per_call: list[int] = []

    def stream(self, prompts: list[Batch | None], steps: list[int]) -> list[Batch | None]:
        self.new_rows_per_call.append(sum(len(p) for p in prompts if p is not None))
        out = []
        for replica, (new, num_steps) in enumerate(zip(prompts, steps)):
            running = self.running[replica]
            running += [(new.take([i]), []) for i in range(len(new))] if new is not None else []
            finished = []
            for _ in range(num_steps):
                for request in running:
                    request[1].append(self.version)
                finished += [request for request in running if self.done(request[1])]
                running = [request for request in running if not self.done(request[1])]
            self.running[replica] = running
            out.append(Batch.concat([self._sample(row, v) for row, v in finished]) if finished else None)
        return out

    def in_flight(self) -> int:
        return sum(len(r) for r in self.running)

    @staticmethod
    def _sample(row: Batch, versions: list[int]) -> Batch:
        """A finished request (no padding: requests finishing together here have equal lengths)."""
        stamped = torch.tensor([versions])  # [1, length]
        return Batch({"sample_seed": row.tensors["sample_seed"], "policy_versions": stamped,
                      "response_mask": torch.ones_like(stamped, dtype=torch.float)}, {"uid": row.non_tensors["uid"]})


def sample_batches():
    """(k, rows): 3 prompts x n=2 rows per loader batch, seeds increasing within a group."""
    for k in itertools.count():
        uids = [f"{k}-{p}" for p in range(PROMPTS_PER_BATCH) for _ in range(N)]
        yield k, Batch({"sample_seed": 100 * k + torch.arange(PROMPTS_PER_BATCH * N)}, {"uid": as_object_array(uids)})


def rollouter(fake: FakeRollout, window: int, extra: int) -> Rollouter:
    r = Rollouter(fake, fake.layout.dp, sample_batches(), N, window, extra, Timeline(), lambda: 0)
    r.thread.start()
    return r


def wait_until(r: Rollouter, predicate: Callable[[], bool]) -> None:
    """Block until `predicate()` holds (checked whenever the rollouter records finished samples)."""
    with r.cond:
        while not predicate():
            r.cond.wait()


def run_trainer(r: Rollouter, fake: FakeRollout, steps: int, per_step: int, trigger: int, bound: int,
                drain: bool) -> list[list[int]]:
    """The fully async trainer's loop with a stand-in update: lags of the groups each step takes."""
    lags, version = [], 0
    for step in range(steps):
        groups, _ = r.take(per_step, version, bound)
        keys = [g.key for g in groups]
        assert keys == sorted(keys)
        for g in groups:  # rows of a group in seed order
            assert g.samples.tensors["sample_seed"].tolist() == sorted(g.samples.tensors["sample_seed"].tolist())
        lags.append([version - g.oldest_version for g in groups])
        version = step + 1
        if (step + 1) % trigger == 0:
            r.pause(drain)
            assert not drain or fake.in_flight() == 0
            fake.version = version  # the sync
            r.resume(new_window=True)
    return lags


def test_budget_and_staleness_bound_without_partial_rollout():
    per_step, trigger, threshold = 2, 2, 0.3
    window = per_step * trigger
    extra = math.floor(threshold * window)  # 1
    bound = trigger - 1 + math.ceil(extra / per_step)  # staleness.max_staleness: 2
    fake = FakeRollout(num_replicas=2, done=lambda versions: len(versions) == 3)
    r = rollouter(fake, window, extra)
    try:
        lags = run_trainer(r, fake, steps=12, per_step=per_step, trigger=trigger, bound=bound, drain=True)
    finally:
        r.close()
    assert fake.new_rows_per_call[0] == (window + extra) * N  # the first window's budget, all at once
    flat = [lag for step in lags for lag in step]
    assert max(flat) == bound and lags[0] == [0, 0] and lags[1] == [1, 1]
    assert r.dropped == 0


def test_pause_without_drain_leaves_requests_running_and_drain_finishes_them():
    fake = FakeRollout(num_replicas=1, done=lambda versions: versions[-1] == 1)  # runs until the sync
    r = rollouter(fake, window=2, extra=0)
    try:
        wait_until(r, lambda: fake.new_rows_per_call)  # the requests have started
        r.pause(drain=False)
        assert fake.in_flight() == 2 * N  # paused mid-generation: partial rollout
        fake.version = 1
        r.resume(new_window=False)
        r.pause(drain=True)
        assert fake.in_flight() == 0 and len(r.queue) == 2
        r.resume(new_window=False)
        groups, metrics = r.take(2, version=1, bound=1)
    finally:
        r.close()
    for g in groups:  # tokens of both versions: the request went on after the sync
        versions = g.samples.tensors["policy_versions"][0]
        assert versions[0] == 0 and versions[-1] == 1
    assert metrics["async/dropped_samples"] == 0


def test_stale_groups_are_dropped_and_their_budget_returned():
    fake = FakeRollout(num_replicas=2, done=lambda versions: len(versions) == 2)
    r = rollouter(fake, window=2, extra=1)
    try:
        wait_until(r, lambda: len(r.queue) == 3)  # generated under version 0, the budget spent
        r.pause(drain=True)
        assert r.budget == 0
        fake.version = 5
        r.resume(new_window=False)
        groups, metrics = r.take(2, version=5, bound=0)
    finally:
        r.close()
    assert [g.oldest_version for g in groups] == [5, 5]
    assert metrics["async/dropped_samples"] == 3 * N
    assert [g.key for g in groups] == [(1, 0), (1, 1)]  # replacements, taken from the next loader batch
