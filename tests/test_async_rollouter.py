"""The fully async rollouter's rules without Ray or models: a stand-in rollout role whose replicas generate one token
per request and engine step, stamped with the version they hold, and finish a request when a rule says so.

The budget (window + extra prompts outstanding after a sync), the staleness bound of staleness.py (reached, never
exceeded), pausing with and without draining (partial rollout), first-in-first-out groups trained in key order, and
dropping stale groups with their budget returned; the feed's pending groups are those read and not taken; a
checkpoint drains, and a rollouter restored from it takes what the first one goes on to take."""

import math
import pickle
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import torch

from shardrl.data.batch import Batch, as_object_array
from shardrl.data.rl_dataset import PromptLoader
from shardrl.trainer.prompt_feed import PromptFeed
from shardrl.trainer.rollouter import ENGINE_KEYS, Rollouter, RolloutState
from shardrl.trainer.staleness import Budget
from shardrl.trainer.tracking import Timeline
from shardrl.workers.rollout import RolloutWorker

N, PROMPTS_PER_BATCH, RESPONSE_LEN = 2, 3, 16


class FakeRollout:
    """A rollout role handle whose `RolloutWorker.stream` is faked per replica: queue the new rows, run `steps` steps,
return what finished (a request is finished when `done(its sample seed, its token versions)`)."""

    def __init__(self, num_replicas: int, done: Callable[[int, list[int]], bool]) -> None:
        self.layout = SimpleNamespace(dp=num_replicas)
        self.done, self.version = done, 0
        self.running: list[list[tuple[Batch, list[int]]]] = [[] for _ in range(num_replicas)]
        self.new_rows_per_call: list[int] = []

    def replicas(self, method) -> int:
        return self.layout.dp

    def call(self, method, *args):
        """As `RoleHandle.call`: only the rollouter's one call, `RolloutWorker.stream`, is faked."""
        assert method is RolloutWorker.stream, method
        return self.stream(*args)

    def stream(self, prompts: list[Batch | None], steps: list[int]) -> list[tuple[Batch | None, dict]]:
        self.new_rows_per_call.append(sum(len(p) for p in prompts if p is not None))
        out = []
        for replica, (new, num_steps) in enumerate(zip(prompts, steps)):
            running = self.running[replica]
            running += [(new.take([i]), []) for i in range(len(new))] if new is not None else []
            finished = []
            for _ in range(num_steps):
                for request in running:  # a request at RESPONSE_LEN - 1 tokens stalls until the next sync
                    if len(request[1]) < RESPONSE_LEN - 1 or request[1][-1] != self.version:
                        request[1].append(self.version)
                finished += [request for request in running if self._done(request)]
                running = [request for request in running if not self._done(request)]
            self.running[replica] = running
            samples = Batch.concat([self._sample(row, v) for row, v in finished]) if finished else None
            out.append((samples, dict.fromkeys(ENGINE_KEYS, 0.0) | {"slots": 4, "tool_idle_spans": []}))
        return out

    def _done(self, request: tuple[Batch, list[int]]) -> bool:
        return self.done(int(request[0].tensors["sample_seed"]), request[1])

    def in_flight(self) -> int:
        return sum(len(r) for r in self.running)

    @staticmethod
    def _sample(row: Batch, versions: list[int]) -> Batch:
        """A finished request, padded to RESPONSE_LEN tokens (version -1 on padding)."""
        stamped = torch.full((1, RESPONSE_LEN), -1)  # [1, R]
        stamped[0, :len(versions)] = torch.tensor(versions)
        return Batch({"sample_seed": row.tensors["sample_seed"], "policy_versions": stamped,
                      "response_mask": (stamped >= 0).float()}, {"uid": row.non_tensors["uid"]})


class Prompts:
    """A stand-in dataset of prompts that are only their index."""

    def __len__(self) -> int:
        return 1000 * PROMPTS_PER_BATCH

    def collate(self, indices: list[int]) -> Batch:
        return Batch({"index": torch.tensor(indices)}, {})


def sample_rows(prompts: Batch, k: int) -> Batch:
    """n=2 rows per prompt of loader batch k, seeds increasing within a group."""
    uids = [f"{k}-{p}" for p in range(len(prompts)) for _ in range(N)]
    return Batch({"sample_seed": 100 * k + torch.arange(len(prompts) * N)}, {"uid": as_object_array(uids)})


def rollouter(fake: FakeRollout, window: int, extra: int, in_order: bool = False,
              restored: RolloutState | None = None) -> Rollouter:
    budget = Budget(per_step=0, trigger=0, window=window, extra=extra)  # the rollouter reads window and extra
    feed = PromptFeed(PromptLoader(Prompts(), PROMPTS_PER_BATCH, shuffle=False), sample_rows, N)
    r = Rollouter(fake, feed, budget, Timeline(), lambda: 0, in_order)
    if restored is not None:
        r.restore(restored)
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
    fake = FakeRollout(num_replicas=2, done=lambda seed, versions: len(versions) == 3)
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
    fake = FakeRollout(num_replicas=1, done=lambda seed, versions: versions[-1] == 1)  # runs until the sync
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
    fake = FakeRollout(num_replicas=2, done=lambda seed, versions: len(versions) == 2)
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


def test_pending_groups_are_every_group_read_and_not_taken():
    """What a checkpoint must generate again (the feed's state): started groups (finished or not) and groups read
    but not started, less those the trainer took."""
    fake = FakeRollout(num_replicas=1, done=lambda seed, versions: len(versions) == 2 + seed % 3)
    r = rollouter(fake, window=4, extra=0)  # batch 0's three groups and batch 1's first start; (1, 1), (1, 2) wait
    try:
        wait_until(r, lambda: len(r.queue) == 4)
        read = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        assert pending(r) == read
        groups, _ = r.take(2, version=0, bound=0)
        assert pending(r) == sorted(set(read) - {g.key for g in groups})
    finally:
        r.close()


@pytest.mark.parametrize("in_order", [False, True])
def test_a_checkpoint_drains_and_a_restored_rollouter_takes_what_the_first_goes_on_to_take(in_order):
    """At the save requests run and groups (1, 1), (1, 2) are read but not started. The checkpoint finishes the
    running requests; a rollouter restored from it (pickled, as a checkpoint holds it) takes the same groups, with the
    same samples and versions, as the first one goes on to take, over a sync: the unstarted groups are read again."""
    def done(seed: int, versions: list[int]) -> bool:
        return len(versions) == 2 + seed % 5

    def go_on(r: Rollouter, fake: FakeRollout) -> list[tuple[tuple[int, int], list, list]]:
        taken = r.take(3, version=0, bound=0)[0]
        r.pause(drain=True)
        fake.version = 1
        r.resume(new_window=True)
        taken += r.take(4, version=1, bound=1)[0]
        return [(g.key, g.samples.tensors["sample_seed"].tolist(), g.samples.tensors["policy_versions"].tolist())
                for g in taken]

    fake = FakeRollout(num_replicas=2, done=done)
    r = rollouter(fake, window=4, extra=0, in_order=in_order)  # batch 0 and (1, 0) start
    try:
        wait_until(r, lambda: fake.new_rows_per_call)
        state = r.checkpoint()
        assert fake.in_flight() == 0 and sorted(g.key for g in state.queue) == [(0, 0), (0, 1), (0, 2), (1, 0)]
        saved = pickle.dumps(state)
        r.resume(new_window=False)
        first = go_on(r, fake)
    finally:
        r.close()
    fake_again = FakeRollout(num_replicas=2, done=done)
    restored = rollouter(fake_again, window=4, extra=0, in_order=in_order, restored=pickle.loads(saved))
    try:
        assert go_on(restored, fake_again) == first
    finally:
        restored.close()
    assert fake_again.new_rows_per_call[0] == 3 * N  # the restored one started only the window after the sync
    assert {key for key, _, _ in first} >= {(1, 1), (1, 2)}


def pending(r: Rollouter) -> list[tuple[int, int]]:
    state = r.feed.state_dict()
    assert state["loader"] == {"epoch": 0, "index": state["first_batch"] * PROMPTS_PER_BATCH}
    return [tuple(key) for key in state["pending"]]


def long_tailed(seed: int, versions: list[int]) -> bool:
    """Response lengths 1..13 tokens by seed, a few long ones: groups finish out of start order."""
    return len(versions) == (1, 1, 2, 3, 5, 8, 13)[seed % 7]


@pytest.mark.parametrize("in_order, per_step, trigger, extra", [(False, 2, 2, 2), (False, 3, 1, 1), (True, 3, 1, 3)])
def test_streaming_with_partial_rollout_keeps_the_bound_and_every_sample_once(in_order, per_step, trigger, extra):
    """Long-tailed requests paused (not drained) at every sync: no taken token is past the bound, every started
    group is taken, dropped or still outstanding exactly once, with its n samples; in order: whole loader batches.
    The feed's pending groups are the outstanding and the not started ones."""
    window = per_step * trigger
    bound = trigger - 1 + math.ceil(extra / per_step)
    fake = FakeRollout(num_replicas=2, done=long_tailed)
    r = rollouter(fake, window, extra, in_order)
    taken = []
    try:
        version = 0
        for step in range(10):
            groups, _ = r.take(per_step, version, bound)
            for g in groups:
                lags = version - g.samples.tensors["policy_versions"][g.samples.tensors["response_mask"].bool()]
                assert 0 <= int(lags.min()) and int(lags.max()) <= bound
                assert sorted(g.samples.tensors["sample_seed"].tolist()) == g.rows.tensors["sample_seed"].tolist()
            taken += [g.key for g in groups]
            if in_order:  # one-step-off: batch `step`, whole
                assert [g.key for g in groups] == [(step, row) for row in range(PROMPTS_PER_BATCH)]
            version = step + 1
            if (step + 1) % trigger == 0:
                r.pause(drain=False)
                fake.version = version
                r.resume(new_window=True)
        r.pause(drain=False)
        outstanding = [g.key for g in r.outstanding]
        assert pending(r) == sorted(outstanding + [g.key for g in r.upcoming])  # dropped groups retired too
        started = sorted(taken + outstanding)
    finally:
        r.close()
    assert len(set(taken)) == len(taken) and not set(taken) & set(outstanding)
    # started in loader order with none skipped: dropped groups are the gaps
    assert started[0] == (0, 0) and r.dropped == N * (len(started) - len(set(started)) + _gaps(started))
    assert len(outstanding) <= window + extra


def _gaps(keys: list[tuple[int, int]]) -> int:
    """Keys missing between the first and the last (loader batches of PROMPTS_PER_BATCH rows)."""
    index = [k * PROMPTS_PER_BATCH + row for k, row in keys]
    return index[-1] - index[0] + 1 - len(index)
