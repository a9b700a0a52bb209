"""The prompt feed of the async modes: the loader's batches as prompt groups for the rollouter, and where a resumed
run reads on.

The rollouter (rollouter.py) reads prompts ahead of the trainer, so the loader's own position would skip the groups
queued or generating at a save. The feed instead keeps the loader's state before every loader batch that still has a
group not yet trained, and the keys (loader batch, row) of all such groups: `state_dict()` is the start of the oldest
of those batches (`loader`, `first_batch`) with the keys (`pending`) and the first batch never read (`read_until`). A
feed restored from it reads on from there and gives exactly the pending groups of the batches read before the save
(with their original sampling seeds: a batch's rows are seeded by its index, as the synchronous step k seeds batch
k), less those the rollouter restores itself (`held`: the finished groups a checkpoint keeps, rollouter.py), then
every group of later batches.

Threads, owners, locks. The trainer builds the feed from its loader (before the schedule starts, nothing else runs)
and hands it to the Rollouter, which owns it from then on; the trainer never touches the loader again. All the feed
holds (the loader, the batch starts, the next batch index, the pending and the resumed groups) is guarded by `lock`
and read or changed only by the feed's methods, each holding the lock for all it does:

* the rollouter's thread reads groups (`read`: advances the loader);
* the trainer's thread retires the groups it took or dropped (`retire`, from `Rollouter.take`) and reads what a
  checkpoint saves (`state_dict`) and the epoch for metrics (`epoch`).

So a state saved while the rollouter's thread reads a batch is the state before or after that read, never half of
it. The feed calls nothing outside itself but the loader and `sample_rows`, so the rollouter may call it while holding
its own lock (`Rollouter.cond`, then `PromptFeed.lock`; never the other way round).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardrl.data.batch import Batch
from shardrl.data.rl_dataset import PromptLoader

Key = tuple[int, int]  # (loader batch, row)


class PromptFeed:
    """Prompt groups from the loader for the rollouter's thread; checkpoint state and epoch for the trainer's."""

    def __init__(self, loader: PromptLoader, sample_rows: Callable[[Batch, int], Batch], group_size: int,
                 first_batch: int = 0) -> None:
        """`sample_rows(prompts, k)`: the `group_size` seeded sample rows per prompt of loader batch k, grouped;
        `first_batch`: the index of the loader's next batch (the trainer's step when not resumed)."""
        self.lock = threading.Lock()
        self.loader, self.sample_rows, self.group_size = loader, sample_rows, group_size
        self.next_batch = first_batch
        self.batch_starts: dict[int, dict[str, int]] = {}  # the loader's state before each batch read, from the
        # oldest with a pending group on
        self.pending: set[Key] = set()  # read, not retired
        self.resumed: dict[int, set[int]] = {}  # after a resume: per batch read before the save and not yet again,
        # the rows to give (none: the batch is read and skipped)
        self.batches: Iterator[Batch] | None = None  # the loader's batches from its position, epoch after epoch

    def read(self) -> list[tuple[Key, Batch]]:
        """The groups of the next loader batch with any to give, each with its `group_size` sample rows: after a
        resume only the resumed rows of the batches read before the save (a batch without any is read and
        skipped), then all rows."""
        with self.lock:
            while True:
                k = self.next_batch
                self.batch_starts[k] = self.loader.state_dict()
                samples = self.sample_rows(next(self._batches()), k)
                self.next_batch = k + 1
                rows = sorted(self.resumed.pop(k)) if k in self.resumed else range(len(samples) // self.group_size)
                if rows:
                    break
            n = self.group_size
            self.pending.update((k, row) for row in rows)
            return [((k, row), samples.take(range(row * n, (row + 1) * n))) for row in rows]

    def retire(self, keys: Iterable[Key]) -> None:
        """Groups trained or dropped: no checkpoint generates them again."""
        with self.lock:
            self.pending.difference_update(keys)
            first = self._first_batch()
            for k in [k for k in self.batch_starts if k < first]:  # no checkpoint from now on needs them
                del self.batch_starts[k]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: `loader` (its state before `first_batch`), `first_batch` (the oldest loader
        batch with a group not trained, or the next to read), `pending` (the keys of every group read or resumed
        and not trained, in key order), `read_until` (the first batch not read before: later ones give all their
        groups)."""
        with self.lock:
            first = self._first_batch()
            loader = self.batch_starts[first] if first < self.next_batch else self.loader.state_dict()
            pending = sorted(self.pending | {(k, row) for k, rows in self.resumed.items() for row in rows})
            read_until = max([self.next_batch, *(k + 1 for k in self.resumed)])
        return {"loader": dict(loader), "first_batch": first, "pending": [list(key) for key in pending],
                "read_until": read_until}

    def load_state_dict(self, state: dict[str, Any], held: Iterable[Key] = ()) -> None:
        """A `state_dict()` of an async checkpoint, or a synchronous one's (the loader's own: nothing was in
        flight, reading goes on at `first_batch`). `held`: pending groups the rollouter restores itself (finished
        before the save): pending still, never read again."""
        with self.lock:
            if "first_batch" not in state:
                state = {"loader": state, "first_batch": self.next_batch, "pending": [],
                         "read_until": self.next_batch}
            self.loader.load_state_dict(state["loader"])
            self.next_batch, self.batches = state["first_batch"], None
            self.batch_starts, self.pending = {}, set(map(tuple, held))
            self.resumed = {k: set() for k in range(state["first_batch"], state["read_until"])}
            for k, row in state["pending"]:
                if (k, row) not in self.pending:
                    self.resumed[k].add(row)

    def epoch(self) -> int:
        """The loader's epoch (of the next prompt to read)."""
        with self.lock:
            return self.loader.state_dict()["epoch"]

    def _first_batch(self) -> int:
        """The oldest batch with a group read (or held) and not retired, or the next to read if older: groups
        resumed and not read yet are of that batch or later ones."""
        return min([self.next_batch, *(k for k, _ in self.pending)])

    def _batches(self) -> Iterator[Batch]:
        if self.batches is None:
            self.batches = self._epochs()
        return self.batches

    def _epochs(self) -> Iterator[Batch]:
        while True:
            yield from self.loader
