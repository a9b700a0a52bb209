"""The async modes' prompt feed without Ray or models, on a stand-in dataset whose prompts are their index.

What a checkpoint saves (the loader's state before the oldest loader batch with a group not trained, that batch, the
keys of every such group, the first batch not read) after any reads and retires, the same while another thread
reads; a feed resumed from it gives exactly the pending groups (same rows, same seeds) less those the rollouter holds,
and then the batches the first feed read next; a synchronous checkpoint's loader state loads."""

import random
import threading
import time
from queue import Queue

import torch

from shardrl.data.batch import Batch, as_object_array
from shardrl.data.rl_dataset import PromptLoader
from shardrl.trainer.prompt_feed import PromptFeed

N, BATCH = 2, 3  # samples per prompt, prompts per loader batch


class Prompts:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def collate(self, indices: list[int]) -> Batch:
        return Batch({"index": torch.tensor(indices)}, {})


def sample_rows(prompts: Batch, k: int, delay: float = 0.0) -> Batch:
    """N rows per prompt, seeded by (k, row) as the trainer seeds loader batch k."""
    time.sleep(delay)  # a slow batch: the loader has moved on, the feed has not yet recorded it
    uids = [f"{k}-{p}" for p in range(len(prompts)) for _ in range(N)]
    return Batch({"index": prompts.tensors["index"].repeat_interleave(N),
                  "sample_seed": 1000 * k + torch.arange(len(prompts) * N)}, {"uid": as_object_array(uids)})


def feed(size: int, shuffle: bool = False, first_batch: int = 0, delay: float = 0.0) -> PromptFeed:
    loader = PromptLoader(Prompts(size), BATCH, shuffle=shuffle, seed=7)
    return PromptFeed(loader, lambda prompts, k: sample_rows(prompts, k, delay), N, first_batch)


def start(k: int, batches_per_epoch: int) -> dict[str, int]:
    """The unshuffled loader's state before batch k."""
    return {"epoch": k // batches_per_epoch, "index": k % batches_per_epoch * BATCH}


def as_keys(state: dict) -> list[tuple[int, int]]:
    return [tuple(key) for key in state["pending"]]


def test_groups_are_the_loader_batches_rows_seeded_by_batch():
    f = feed(7)  # 2 batches of 3 per epoch, the 7th prompt dropped
    groups = [f.read() for _ in range(3)]
    assert [[key for key, _ in g] for g in groups] == [[(k, row) for row in range(BATCH)] for k in range(3)]
    key, rows = groups[2][1]  # batch 2 is the first of epoch 1: prompts 0..2 again
    assert rows.tensors["index"].tolist() == [1] * N
    assert rows.tensors["sample_seed"].tolist() == [2000 + N, 2000 + N + 1]
    assert f.epoch() == 1


def test_state_after_reads_and_retires_is_the_oldest_batch_with_a_group_not_trained():
    """Random reads and retires, against the rule computed from scratch: the oldest batch with a pending group (or
    the next to read), the unshuffled loader's state before it, the pending keys."""
    rng = random.Random(0)
    f, read, pending = feed(7), 0, set()
    assert f.state_dict() == {"loader": start(0, 2), "first_batch": 0, "pending": [], "read_until": 0}
    for _ in range(300):
        if rng.random() < 0.4:
            pending |= {key for key, _ in f.read()}
            read += 1
        elif pending:
            done = rng.sample(sorted(pending), rng.randint(1, len(pending)))
            f.retire(done)
            pending -= set(done)
        first = min((k for k, _ in pending), default=read)
        assert f.state_dict() == {"loader": start(first, 2), "first_batch": first,
                                  "pending": [list(key) for key in sorted(pending)], "read_until": read}
        assert f.epoch() == read // 2
    f.retire(pending)
    assert f.batch_starts == {}  # nothing kept for batches no checkpoint needs


def test_resume_gives_exactly_the_pending_groups_then_reads_on():
    """Feed A reads 4 batches (shuffled, over an epoch's end) and trains some groups, batch 2's all; a feed resumed
    from A's state gives the rest again with A's rows (batch 2 read and skipped), then batch 4 as A reads it. A save
    while resumed groups are still unread keeps them."""
    a = feed(10, shuffle=True)  # 3 batches per epoch
    read = {key: rows for _ in range(4) for key, rows in a.read()}
    a.retire([(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1), (2, 2), (3, 1)])
    saved = a.state_dict()
    assert saved["first_batch"] == 1 and as_keys(saved) == [(1, 1), (3, 0), (3, 2)]

    b = feed(10, shuffle=True)
    b.load_state_dict(saved)
    assert b.state_dict() == saved
    batch_1 = b.read()
    assert [key for key, _ in batch_1] == [(1, 1)] and b.state_dict() == saved  # (3, *) not read yet, still pending
    b.retire([(1, 1)])
    resumed_twice = feed(10, shuffle=True)
    resumed_twice.load_state_dict(b.state_dict())  # next to read: batch 2, whose groups are all trained
    assert b.state_dict()["first_batch"] == 2 and as_keys(b.state_dict()) == [(3, 0), (3, 2)]
    for f in (b, resumed_twice):
        groups = f.read()
        assert [key for key, _ in groups] == [(3, 0), (3, 2)]
        for key, rows in groups:
            assert rows.tensors["index"].tolist() == read[key].tensors["index"].tolist()
            assert rows.tensors["sample_seed"].tolist() == read[key].tensors["sample_seed"].tolist()
    next_a, next_b = a.read(), b.read()
    assert [key for key, _ in next_b] == [key for key, _ in next_a] == [(4, row) for row in range(BATCH)]
    for (_, rows_a), (_, rows_b) in zip(next_a, next_b):
        assert rows_a.tensors["index"].tolist() == rows_b.tensors["index"].tolist()
    assert b.epoch() == a.epoch() == 1


def test_groups_the_rollouter_holds_stay_pending_and_are_never_read_again():
    """A checkpoint kept batch 1's groups 0 and 2 and all of batch 2's finished (the rollouter restores them); the
    resumed feed gives only batch 1's group 1, reads batch 2 without giving any, then reads on with batch 4 after
    batch 3 (read before the save, nothing of it pending: all trained). The held groups stay pending until retired."""
    saved = {"loader": start(1, 10), "first_batch": 1, "pending": [[1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2]],
             "read_until": 4}
    held = [(1, 0), (1, 2), (2, 0), (2, 1), (2, 2)]
    f = feed(30)
    f.load_state_dict(saved, held=held)
    assert f.state_dict() == saved  # nothing read yet: the same state
    assert [key for key, _ in f.read()] == [(1, 1)]
    assert [key for key, _ in f.read()] == [(4, row) for row in range(BATCH)]
    f.retire([(1, 0), (1, 1), (1, 2)])
    state = f.state_dict()
    assert state["first_batch"] == 2 and state["loader"] == start(2, 10)  # batch 2 was read (skipped) on resume
    assert as_keys(state) == [*held[2:], *((4, row) for row in range(BATCH))] and state["read_until"] == 5
    f.retire(held[2:])
    assert f.state_dict()["first_batch"] == 4


def test_loads_a_synchronous_checkpoints_loader_state():
    """Nothing was in flight: reading goes on at the feed's first batch, the trainer's step."""
    sync = feed(7, first_batch=3)
    sync.load_state_dict({"epoch": 1, "index": 3})
    assert sync.state_dict() == {"loader": start(3, 2), "first_batch": 3, "pending": [], "read_until": 3}
    groups = sync.read()
    assert [key for key, _ in groups] == [(3, row) for row in range(BATCH)]
    assert groups[0][1].tensors["index"].tolist() == [3] * N


def test_state_is_consistent_while_another_thread_reads():
    """A thread reads slow batches while this one retires what it read and saves states: every state is whole,
    never a batch half read (the loader moved on, the batch not recorded)."""
    f = feed(30, delay=0.0005)  # 10 batches per epoch
    read: Queue = Queue()

    def reader() -> None:
        for _ in range(300):
            read.put([key for key, _ in f.read()])
        read.put(None)

    thread = threading.Thread(target=reader)
    thread.start()
    retired: set[tuple[int, int]] = set()
    seen: set[tuple[int, int]] = set()
    while True:
        while not read.empty():
            if (keys := read.get()) is None:
                break
            seen |= set(keys)
            if keys[0][0] % 3:  # keep every third batch pending a while
                f.retire(keys)
                retired |= set(keys)
        else:
            state, epoch = f.state_dict(), f.epoch()
            pending, first = set(as_keys(state)), state["first_batch"]
            assert state["loader"] == start(first, 10), state
            assert seen - retired <= pending and not pending & retired
            last = max((k for k, _ in pending), default=first - 1)
            assert pending | retired >= {(k, row) for k in range(first, last + 1) for row in range(BATCH)}
            assert epoch >= first // 10
            continue
        break
    thread.join()
    f.retire(seen)
    assert f.state_dict() == {"loader": start(300, 10), "first_batch": 300, "pending": [], "read_until": 300}
