"""Fixtures shared by several test files, and the switch to Triton's interpreter on machines without CUDA."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU Triton can only interpret (tests/test_kernels_interpreted.py). The switch must precede triton's
    # import: triton.language's own helpers (tl.zeros, ...) are decorated then, and stay compiled-only otherwise.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def loops() -> Iterator[Callable[[], asyncio.AbstractEventLoop]]:
    """A maker of event loops, each running in a thread of its own (as the rollout's runner runs its loop); all are
    stopped and closed after the test."""
    started: list[tuple[asyncio.AbstractEventLoop, threading.Thread]] = []

    def start() -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        started.append((loop, thread))
        return loop

    yield start
    for loop, thread in started:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
