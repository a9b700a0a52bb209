"""A custom reward function (verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`, sync or
`async def`) run in processes of its own, so that it cannot hang or crash the trainer.

The user's file is never imported here: it runs in a FunctionPool (shardrl.usercode.pool), which times out each
sample, contains crashes and restarts dead processes, and kills everything at close (a sync call that never returns
included). Each batch is scored concurrently across the pool; a sample that raises, times out or returns no score
is a one-line RewardFunctionError naming the function and the sample, or, with on_error="zero", a score of 0.0
whose reason is returned beside the scores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType

from shardrl.rewards.outcomes import (SAMPLE_FIELDS, BatchScores, OnError, RewardFunctionError, Sample, check_on_error,
                                      collect_scores)
from shardrl.usercode.pool import CallResult, FunctionPool, check_positive
from shardrl.usercode.wire import LoadError


class GuardedScoreFn:
    """The function `name` of the Python file `path`, loaded in `num_workers` processes at construction
    (RewardFunctionError if it cannot be). Each worker runs up to `max_concurrent_per_worker` samples at once: an
    async function as tasks, a sync one in threads that share its GIL (for a CPU-bound function, raise num_workers
    rather than this). `timeout` is in seconds per sample, counted from when a worker takes it. `memory_limit_mb`
    caps each worker's address space, thread stacks included (8 MiB each). Close it (or use it as a context
    manager) to end the workers."""

    def __init__(self, path: str, name: str, *, num_workers: int, timeout: float, on_error: OnError,
                 max_concurrent_per_worker: int = 8, memory_limit_mb: int | None = None) -> None:
        check_positive("GuardedScoreFn", num_workers=num_workers, timeout=timeout,
                       max_concurrent_per_worker=max_concurrent_per_worker, memory_limit_mb=memory_limit_mb)
        check_on_error(on_error)
        self.on_error = on_error
        self.timeout = timeout
        file = os.path.abspath(os.path.expanduser(path))  # absolute: a file, never a module off sys.path
        self._pool = FunctionPool(f"{file}:{name}", num_processes=num_workers, timeout=timeout,
                                  max_concurrent_per_process=max_concurrent_per_worker,
                                  memory_limit_mb=memory_limit_mb, label="reward", arity=SAMPLE_FIELDS)
        self.name = f"reward function {self._pool.target}"  # how errors start
        try:
            self._pool.start()
        except LoadError as exc:
            raise RewardFunctionError(str(exc)) from None

    def score_batch(self, samples: Sequence[Sample]) -> BatchScores:
        """Score every sample at once across the workers; the results in order. A TypeError (the caller's bug) for
        a sample JSON cannot carry (numpy values can)."""
        results = self._pool.map([tuple(sample) for sample in samples])
        return collect_scores(self.name, samples, [self._outcome(result) for result in results], self.on_error)

    def close(self) -> None:
        """End the workers and all they started. Idempotent."""
        self._pool.close()

    def __enter__(self) -> GuardedScoreFn:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _outcome(self, result: CallResult) -> tuple[object, str | None]:
        if result.timed_out:  # the pool's own message names the function again: collect_scores already does
            return None, f"timed out after {self.timeout:g} s"
        return result.value, result.error
