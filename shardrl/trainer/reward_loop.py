"""Scoring that overlaps generation (`reward_model.use_reward_loop`): the synchronous step streams its samples out of
the engines (`stream_generation`) and a scoring thread (`ScoringThread`) scores each one as soon as it finishes,
while the others still decode, so that only the samples finishing last are scored after generation.

Threads: the trainer's thread runs the stream and hands finished samples over (`submit`); the scoring thread runs
the scorer (reward function, reward service, reward model worker), taking everything that finished since its last
call as one batch, so a concurrent scorer (the reward-function pool, the reward model's DP) gets as much at once as
there is. A scorer error (a reward function failing with `on_error=fail`) is re-raised on the trainer's thread by the
next `submit` or by `finish`, as the same exception.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from shardrl.controller.group import RoleHandle
from shardrl.data.batch import Batch, as_object_array
from shardrl.rewards.manager import SampleScores
from shardrl.trainer.tracking import Timeline

STEPS_PER_CALL = 8  # engine steps per stream call: how long a finished sample may wait before it is scored
Scorer = Callable[[Batch], tuple[Batch, SampleScores]]


def stream_generation(handle: RoleHandle, method: Callable[..., Any], samples: Batch,
                      on_finished: Callable[[Batch], None]) -> list[list[dict[str, Any]]]:
    """Generate one response per row of `samples` through `method` (a PER_REPLICA streaming method: new rows per
    replica and an engine-step count in, finished samples and a report out), handing each call's finished samples
    to `on_finished` (in finishing order). Rows go to replicas in contiguous shares, as DP_COMPUTE splits a batch.
    The next call is queued at the workers before the last one's result is read, so the engines never wait for the
    controller between calls (the call after the last sample finishes finds no work and returns at once).
    Returns each replica's reports, one per call."""
    replicas = handle.replicas(method)
    share = -(-len(samples) // replicas)
    first = [samples.take(list(range(r * share, min((r + 1) * share, len(samples)))))
             if r * share < len(samples) else None for r in range(replicas)]
    steps = [STEPS_PER_CALL] * replicas
    calls = deque([handle.submit(method, first, steps)])
    pending, reports = len(samples), [[] for _ in range(replicas)]
    while calls:
        if pending:
            calls.append(handle.submit(method, [None] * replicas, steps))
        for replica, (finished, report) in enumerate(calls.popleft().get()):
            reports[replica].append(report)
            if finished is not None:
                pending -= len(finished)
                on_finished(finished)
    return reports


class ScoringThread:
    """Scores the samples `submit` hands it with `score`, on a thread of its own, from construction to `finish`.
    Its scoring spans go on the timeline (lane "reward", phase "score") and its metrics say how much of the scoring
    the generation hid."""

    def __init__(self, score: Scorer, timeline: Timeline, step: Callable[[], int],
                 on_scored: Callable[[Batch, SampleScores], None] | None = None) -> None:
        """`step`: the trainer step the spans belong to, asked at each call. `on_scored`: called (on the scoring
        thread) with each call's result instead of keeping it for `finish` (the async modes' rollouter)."""
        self.score, self.timeline, self.step, self.on_scored = score, timeline, step, on_scored
        self.cond = threading.Condition()
        self.waiting: list[Batch] = []  # submitted, not yet taken by the thread
        self.scored: list[tuple[Batch, SampleScores]] = []
        self.spans: list[tuple[float, float]] = []  # perf_counter start/end of each scoring call
        self.closing = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="reward-loop", daemon=True)
        self.thread.start()

    def submit(self, samples: Batch) -> None:
        with self.cond:
            self._raise_error()
            self.waiting.append(samples)
            self.cond.notify_all()

    def finish(self) -> tuple[Batch, SampleScores, dict[str, float]]:
        """Once generation is done: wait for the rest to be scored; the scored batch and its scores in row order
        (by `sample_seed`) and the metric `timing_s/reward_hidden`: of the seconds the scorer ran (its "score"
        spans, `timing_s/score`), those while generation still ran. The caller times this wait (the exposed part,
        `timing_s/reward`)."""
        generation_end = time.perf_counter()
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join()
        self._raise_error()
        batch, scores = _in_row_order(self.scored)
        hidden = sum(max(0.0, min(end, generation_end) - start) for start, end in self.spans)
        return batch, scores, {"timing_s/reward_hidden": hidden}

    def close(self) -> None:
        """Stop the thread without waiting for scores (generation failed); idempotent."""
        with self.cond:
            self.closing = True
            self.waiting.clear()
            self.cond.notify_all()
        self.thread.join()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closing:
                    self.cond.wait()
                if not self.waiting:
                    return
                chunk, self.waiting = Batch.concat(self.waiting), []
            start = time.perf_counter()
            try:
                with self.timeline.phase(self.step(), "score", lane="reward"):
                    result = self.score(chunk)
            except BaseException as error:  # the trainer's thread raises it
                with self.cond:
                    self.error, self.waiting = error, []
                return
            with self.cond:
                self.spans.append((start, time.perf_counter()))
                if self.on_scored is None:
                    self.scored.append(result)
            if self.on_scored is not None:
                self.on_scored(*result)


def _in_row_order(scored: list[tuple[Batch, SampleScores]]) -> tuple[Batch, SampleScores]:
    """The scored chunks as one batch, rows sorted by `sample_seed` (the order they were generated in)."""
    batch, scores = concat_scored(scored)
    return take_scored(batch, scores, torch.argsort(batch.tensors["sample_seed"]))


def concat_scored(scored: list[tuple[Batch, SampleScores]]) -> tuple[Batch, SampleScores]:
    """Scored batches as one, their scores and extras (None where a batch's samples had no such extra) with them."""
    keys = {key: None for _, s in scored for key in s.extras}
    extras = {key: [v for b, s in scored for v in s.extras.get(key, [None] * len(b))] for key in keys}
    return Batch.concat([b for b, _ in scored]), SampleScores(
        torch.cat([s.token_level for _, s in scored]), torch.cat([s.scores for _, s in scored]), extras)


def take_scored(batch: Batch, scores: SampleScores, rows: torch.Tensor) -> tuple[Batch, SampleScores]:
    """The rows `rows` of a scored batch, with their scores and extras."""
    index = rows.numpy()
    extras = {key: as_object_array(values)[index].tolist() for key, values in scores.extras.items()}
    return batch.take(rows), SampleScores(scores.token_level[rows], scores.scores[rows], extras)
