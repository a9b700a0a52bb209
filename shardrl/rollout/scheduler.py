"""Continuous batching: which requests run in the next engine step.

Each step is either a prefill (whole sequences entering the cache) or a decode (one token for every running
sequence). Prefill goes first whenever a waiting request fits, so the decode batch refills as soon as sequences
finish; a prefill batch takes waiting requests in arrival order while a cache slot is free, at most `max_num_seqs`
run, and its tokens stay within `max_num_batched_tokens`. A request the scheduler drops mid-run (abort) gives its
slot back; when resumed it is prefilled again from prompt plus generated tokens.

Multi-turn trajectories keep their cache between turns: a finished request that asked for it is *parked* (it keeps
its slot, not running), and the request continuing it (the next turn: everything so far plus the environment's
tokens) takes that slot with the shared prefix already cached, so its prefill runs only the new tokens. A parked
slot is lent out when a new sequence finds no free one (the oldest parked first). Its prefix is then moved to a
*spare row* of the cache if there is one (rows beyond the decode slots, which no decode step reads: a trajectory
waiting on its tool needs its keys and values, not a decode row), and its continuation, once it gets a decode slot
again, has the prefix copied back and prefills only its new tokens; the oldest spared prefix gives its row up when
none is free. Without a spare row the prefix is dropped and the continuation prefilled whole. Copies are listed in
the batch (`Batch.moves`): all of a step's moves into spare rows before its moves out of them, since a decode slot
may be lent and refilled in the same step. Prefill batches are all continuations or all fresh sequences: the two
run different attention.

A continuation of at most `max_fed_tokens` new tokens that arrives while others decode is not prefilled: it joins
the decode batch at once and its rows feed its new tokens one per step (their samples dropped) until the last, whose
sample is its first token. A prefill step stalls every running row and costs a whole forward of fixed overhead; fed
tokens cost a row each in steps that run anyway.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

from shardrl.rollout.request import Request


@dataclass(frozen=True)
class Batch:
    """A prefill of `requests` (arrival order), or a decode over slots 0..num_rows-1 where `requests` are the
    running ones in slot order. The other rows ride along, computed and ignored: a free slot at position 0, a held
    one (parked, or a waiting continuation's) at `idle_positions[slot]`, the first position its continuation
    recomputes, so the row's writes never touch the cached prefix."""

    kind: Literal["prefill", "decode"]
    requests: list[Request]
    num_rows: int
    idle_positions: dict[int, int] = field(default_factory=dict)
    moves: list[RowMove] = field(default_factory=list)  # to run on the cache before the step, in order


@dataclass(frozen=True)
class RowMove:
    """Copy positions 0..length-1 of cache row `source` into row `destination` (a prefix into or out of a spare
    row)."""

    source: int
    destination: int
    length: int


class Scheduler:
    def __init__(self, num_slots: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_fed_tokens: int = 0, spare_rows: range = range(0)) -> None:
        self.max_fed_tokens = max_fed_tokens
        self.max_running = min(num_slots, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(self.max_running))  # a heap: the lowest free slot is handed out first
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.parked: OrderedDict[str, Request] = OrderedDict()  # finished, holding their slot; oldest first
        self.free_spares = list(spare_rows)
        self.spared: OrderedDict[str, Request] = OrderedDict()  # parked ones whose prefix sits in a spare row
        self._moves_out: list[RowMove] = []  # this step's moves into spare rows, then out of them
        self._moves_in: list[RowMove] = []
        self._emptied_spares: list[int] = []  # read by this step's moves; free from the next step on
        self.evictions = 0  # parked slots lent to new sequences with their prefix dropped
        self.spared_prefixes = 0  # parked slots lent to new sequences with their prefix moved to a spare row

    def add(self, request: Request, front: bool = False) -> None:
        if request.prefill_len > self.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id}: {request.prefill_len} tokens to prefill exceed "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}; raise it")
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the next `schedule()` would prefill (a waiting request always fits the token budget alone)."""
        return bool(self.waiting) and self._has_slot_for(self.waiting[0])

    def schedule(self) -> Batch | None:
        """The next step; the caller runs its `moves` on the cache first."""
        self.free_spares += self._emptied_spares  # the moves that read them ran before this step
        self._emptied_spares = []
        if self.running:
            self._take_fed()
        prefill = self._take_prefill()
        moves = self._moves_out + self._moves_in
        self._moves_out, self._moves_in = [], []
        if prefill:
            return Batch("prefill", prefill, len(prefill), moves=moves)
        if not self.running:
            return None
        slots = sorted(self.running)
        num_rows = slots[-1] + 1
        held = {r.slot: r.num_tokens - 1 for r in self.parked.values()}
        held |= {r.slot: r.cached for r in self.waiting if r.slot is not None}
        return Batch("decode", [self.running[s] for s in slots], num_rows,
                     {slot: pos for slot, pos in held.items() if slot < num_rows}, moves)

    def _has_slot_for(self, request: Request) -> bool:
        return request.slot is not None or bool(self.free_slots) or bool(self.parked)

    def _take_fed(self) -> None:
        """Move short continuations (slot held, or one to be had for a spared prefix; few new tokens) from the
        queue into the decode batch, fed."""
        kept: deque[Request] = deque()
        for request in self.waiting:
            short = request.cached > 0 and request.prefill_len <= self.max_fed_tokens
            if short and request.slot is None and request.spare is not None and self._has_slot_for(request):
                self._assign_slot(request)
            if short and request.slot is not None:
                request.feed = request.cached
                self.running[request.slot] = request
            else:
                kept.append(request)
        self.waiting = kept

    def _take_prefill(self) -> list[Request]:
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and self._has_slot_for(self.waiting[0]):
            request = self.waiting[0]
            if batch and (request.cached > 0) != (batch[0].cached > 0):
                break
            if num_tokens + request.prefill_len > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            if request.slot is None:
                self._assign_slot(request)
            self.running[request.slot] = request
            batch.append(request)
            num_tokens += request.prefill_len
        return batch

    def release(self, request: Request) -> None:
        """Give a finished or aborted running request's slot back (or park it: `request.keep_cache`)."""
        del self.running[request.slot]
        if request.keep_cache and request.finish_reason is not None:
            self.parked[request.request_id] = request
            return
        self._free(request)

    def take_parked(self, request_id: str) -> Request | None:
        """The parked request `request_id` and with it its slot or spare row (None: never parked, released or its
        prefix dropped)."""
        return self.parked.pop(request_id, None) or self.spared.pop(request_id, None)

    def release_parked(self, request_ids: set[str] | None = None) -> None:
        """Free the slots and spare rows of parked requests (all when None)."""
        for store in (self.parked, self.spared):
            for rid in list(store) if request_ids is None else [r for r in request_ids if r in store]:
                self._free(store.pop(rid))

    def free_slot(self, request: Request) -> None:
        """Give back the slot or spare row a request holds outside the running set (a continuation that keeps
        nothing of it)."""
        self._free(request)

    def _assign_slot(self, request: Request) -> None:
        """Give a waiting request a decode slot (lending a parked one's if none is free); a spared prefix is
        copied into it."""
        if not self.free_slots:
            self._lend_oldest_parked()
        request.slot = heapq.heappop(self.free_slots)
        if request.spare is not None:
            self._moves_in.append(RowMove(request.spare, request.slot, request.cached))
            self._emptied_spares.append(request.spare)
            request.spare = None

    def _lend_oldest_parked(self) -> None:
        """Free the oldest parked request's slot, its prefix moved to a spare row (the oldest spared prefix gives
        its row up if none is free) or, without spare rows, dropped."""
        _, request = self.parked.popitem(last=False)
        length = request.num_tokens - 1  # what its continuation would find cached
        if not self.free_spares and self.spared:
            self._free(self.spared.popitem(last=False)[1])
            self.evictions += 1
        if not self.free_spares or length < 1:
            self._free(request)
            self.evictions += 1
            return
        request.spare = self.free_spares.pop()
        self._moves_out.append(RowMove(request.slot, request.spare, length))
        heapq.heappush(self.free_slots, request.slot)
        request.slot = None
        self.spared[request.request_id] = request
        self.spared_prefixes += 1

    def _free(self, request: Request) -> None:
        if request.slot is not None:
            heapq.heappush(self.free_slots, request.slot)
        if request.spare is not None:
            self.free_spares.append(request.spare)
        request.slot = request.spare = None
        request.cached = 0
        request.feed = None

    def remove(self, request_ids: set[str] | None) -> list[Request]:
        """Take requests (all when None) out of the scheduler, running ones first in slot order, then waiting.
        Slots go back, continuations' included: a removed request is prefilled whole when it comes back."""
        taken = [r for _, r in sorted(self.running.items()) if request_ids is None or r.request_id in request_ids]
        for request in taken:
            del self.running[request.slot]
            self._free(request)
        kept: deque[Request] = deque()
        for request in self.waiting:
            if request_ids is None or request.request_id in request_ids:
                self._free(request)
                taken.append(request)
            else:
                kept.append(request)
        self.waiting = kept
        return taken
