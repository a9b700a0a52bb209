"""The timer of the kernel benches: milliseconds per call of a function on the current CUDA stream."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Mean milliseconds of `iters` back-to-back calls of `fn` after `warmup` untimed ones, timed by CUDA events (the
    GPU's time from the first timed launch to the last one's end)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
