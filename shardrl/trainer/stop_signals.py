"""SIGTERM stops a run as Ctrl-C does: `kill`, Slurm's scancel and time limit, and Kubernetes send it to end a job,
and the run should end as a user's Ctrl-C ends it (workers stopped, the summary printed, a one-line error from
`main_ppo`), not with the driver gone and its workers following it unannounced."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


_sigterm_received = threading.Event()


def _raise_terminated(signum: int, frame: object) -> None:
    """SIGTERM in the driver raises KeyboardInterrupt in the main thread, where Ctrl-C raises it, so that both stop
    a run the same way."""
    _sigterm_received.set()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the driver at once
    raise KeyboardInterrupt


def stopped_by_sigterm() -> bool:
    """Whether a KeyboardInterrupt that ended the run came from SIGTERM: asked of the process, not of the
    exception, because code it passes through (Ray's blocking calls) may raise a plain KeyboardInterrupt anew."""
    return _sigterm_received.is_set()


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """While inside, SIGTERM raises KeyboardInterrupt in the main thread. Entered after Ray starts in the driver: Ray's
    core installs its own SIGTERM handler there (it logs and aborts). An inherited ignore is respected, as for
    SIGINT; off the main thread (an embedding caller's) signals cannot be handled, so nothing changes there."""
    install = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if install else None
    try:
        yield
    finally:
        if install:  # a handler installed outside Python (Ray's) reads as None and cannot be put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
