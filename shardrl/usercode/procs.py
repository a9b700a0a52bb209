"""OS process groups (not torch.distributed's) and pidfds: signalling a group, waiting until every process of it is
gone, reading exit codes.

A child started with `start_new_session=True` leads a group that holds all it starts (unless that leaves the group
with setsid), so killing the group is how user code is stopped with whatever it spawned.
"""

from __future__ import annotations

import os
import select
import signal
import time

_KILL_WAIT = 5.0  # seconds to wait for SIGKILLed processes to be gone (one stuck in the kernel may take longer)


def kill_group(pgid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal every process of group `pgid` (0: the caller's own group); nothing happens if it is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def await_group(pgid: int) -> None:
    """Wait until every process of the SIGKILLed group has exited: killpg returns before they are gone."""
    deadline = time.monotonic() + _KILL_WAIT
    for pid in _group_members(pgid):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped meanwhile
            continue
        ready([pidfd], max(0.0, deadline - time.monotonic()))
        os.close(pidfd)


def _group_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that have not exited yet, from /proc."""
    members = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as file:
                state, _, group = file.read().rpartition(")")[2].split()[:3]
        except OSError:  # exited meanwhile
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            members.append(int(name))
    return members


def ready(fds: list[int], timeout: float | None) -> set[int]:
    """Those of `fds` that can be read (or hit end of file) within `timeout` seconds; poll, unlike select, takes any
    fd number (a trainer may hold over 1024 files)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)}


def exit_text(code: int) -> str:
    """A Popen return code as a reader wants it: "exit code 3", or "exit code -9: Killed"."""
    if code >= 0:
        return f"exit code {code}"
    return f"exit code {code}: {signal.strsignal(-code) or f'signal {-code}'}"
