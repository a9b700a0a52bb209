"""Continuous batching: which requests run in the next engine step.

Each step is either a prefill (whole sequences entering the cache) or a decode (one token for every running
sequence). Prefill goes first whenever a waiting request fits, so the decode batch refills as soon as sequences
finish; a prefill batch takes waiting requests in arrival order while a cache slot is free, at most `max_num_seqs`
run, and its tokens stay within `max_num_batched_tokens`. A request the scheduler drops mid-run (abort) gives its
slot back; when resumed it is prefilled again from prompt plus generated tokens.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Literal

from shardrl.rollout.request import Request


@dataclass(frozen=True)
class Batch:
    """A prefill of `requests` (arrival order), or a decode over slots 0..num_rows-1 where `requests` are the
    running ones in slot order (the other rows are free slots, computed and ignored)."""

    kind: Literal["prefill", "decode"]
    requests: list[Request]
    num_rows: int


class Scheduler:
    def __init__(self, num_slots: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_running = min(num_slots, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(self.max_running))  # a heap: the lowest free slot is handed out first
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    def add(self, request: Request, front: bool = False) -> None:
        if request.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id}: {request.num_tokens} tokens to prefill exceed "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}; raise it")
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the next `schedule()` would prefill (a waiting request always fits the token budget alone)."""
        return bool(self.waiting and self.free_slots)

    def schedule(self) -> Batch | None:
        prefill = self._take_prefill()
        if prefill:
            return Batch("prefill", prefill, len(prefill))
        if not self.running:
            return None
        slots = sorted(self.running)
        return Batch("decode", [self.running[s] for s in slots], slots[-1] + 1)

    def _take_prefill(self) -> list[Request]:
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and self.free_slots:
            request = self.waiting[0]
            if num_tokens + request.num_tokens > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            request.slot = heapq.heappop(self.free_slots)
            self.running[request.slot] = request
            batch.append(request)
            num_tokens += request.num_tokens
        return batch

    def release(self, request: Request) -> None:
        """Give a finished or aborted running request's slot back."""
        del self.running[request.slot]
        heapq.heappush(self.free_slots, request.slot)
        request.slot = None

    def remove(self, request_ids: set[str] | None) -> list[Request]:
        """Take requests (all when None) out of the scheduler, running ones first in slot order, then waiting."""
        taken = [r for _, r in sorted(self.running.items()) if request_ids is None or r.request_id in request_ids]
        for request in taken:
            self.release(request)
        kept: deque[Request] = deque()
        for request in self.waiting:
            (taken if request_ids is None or request.request_id in request_ids else kept).append(request)
        self.waiting = kept
        return taken
