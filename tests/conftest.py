"""Fixtures shared by several test files."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest


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
