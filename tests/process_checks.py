"""Helpers for tests of code that runs the user's functions in child processes: starting it on a source file,
awaiting calls on an event loop in another thread (as the rollout's runner awaits them), and what is still running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

Started = TypeVar("Started")


@contextlib.contextmanager
def started_from_source(path: Path, default_function: str,
                        build: Callable[..., Started]) -> Iterator[Callable[..., Started]]:
    """`make(source, function=default_function, **options)`: writes `source` as `path`, builds
    `build("<file name>:<function>", base_dir=<its folder>, **options)` and starts it; all are closed at the end."""
    with contextlib.ExitStack() as started:
        def make(source: str, function: str = default_function, **options: Any) -> Started:
            path.write_text(textwrap.dedent(source))
            made = build(f"{path.name}:{function}", base_dir=str(path.parent), **options)
            started.callback(made.close)
            made.start()
            return made
        yield make


def gather_on(loop: asyncio.AbstractEventLoop, *awaitables: Awaitable[Any]) -> list[Any]:
    """Await them all at once on `loop` (in its thread); their results in order."""
    async def gather_all() -> list[Any]:
        return list(await asyncio.gather(*awaitables))
    return asyncio.run_coroutine_threadsafe(gather_all(), loop).result(timeout=30)


def gone(pid: int) -> bool:
    """The process has exited: it has no /proc entry any more, or it is a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds `text` (a zombie has an empty one)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found
