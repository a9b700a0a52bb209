"""One child of a FunctionPool as the parent sees it: its pipes, the threads that serve them, the calls it holds.

Everything a child sends is untrusted: a line that is no JSON, a reply to a call it was not given, a line past
`MAX_LINE` ends the child. When it dies, for whatever reason, its watcher thread kills its whole group, waits for
it, and only then tells the pool (which fails the calls it held and starts a replacement).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NamedTuple, Protocol

from shardrl.usercode.procs import await_group, kill_group, ready
from shardrl.usercode.wire import MAX_LINE, one_line, write_all

_LOAD_TIMEOUT = 120.0  # seconds a child may take to import the target (user modules may import heavy packages)


class Reply(NamedTuple):
    value: Any = None
    error: str | None = None  # one line
    crashed: bool = False  # lost with its process


class Listener(Protocol):
    """What the pool does as its children's threads see things happen; each is called without the pool's lock."""

    def on_ready(self, child: ChildProcess) -> None: ...

    def on_reply(self, child: ChildProcess, key: int, reply: Reply) -> str | None: ...  # what is wrong, if anything

    def on_death(self, child: ChildProcess, code: int, problem: str) -> None: ...


class ChildProcess:
    """`state`, `pending` and `abandoned` change only under the pool's lock."""

    def __init__(self, arguments: list[str], env: dict[str, str] | None, listener: Listener) -> None:
        """Start `python -m shardrl.usercode.child FROM_PARENT TO_PARENT *arguments` in a session of its own (its
        group is what gets killed), with a pipe each way and a watcher and a writer thread to serve them."""
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        command = [sys.executable, "-m", "shardrl.usercode.child", str(from_parent), str(to_parent), *arguments]
        try:
            self.popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(from_parent, to_parent),
                                          start_new_session=True, env=env)
        except OSError:
            os.close(to_child)
            os.close(from_child)
            raise
        finally:  # the child holds these ends now
            os.close(from_parent)
            os.close(to_parent)
        self.listener = listener
        self.state = "starting"  # -> "live" once it loaded the target (-> "retiring" when stuck) -> "dead"
        self.loaded = threading.Event()  # set once it is live or dead
        self.load_error: str | None = None
        self.pending: dict[int, Any] = {}  # the pool's record of each call it runs (abandoned ones too, until they end)
        self.abandoned: set[int] = set()  # timed out or cancelled: their callers have had their answer
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reap_lock = threading.Lock()  # signals go to its group only while its pid cannot have been reused
        self._reaped = False
        pid = self.popen.pid
        self.watcher = threading.Thread(target=self._watch, args=(from_child,), daemon=True,
                                        name=f"usercode-watch-{pid}")
        self.watcher.start()
        threading.Thread(target=_feed, args=(to_child, self._outbox), daemon=True,
                         name=f"usercode-feed-{pid}").start()

    def send(self, line: bytes) -> None:
        """Queue a line for the child; its writer thread sends it, so a child that stops reading blocks nobody."""
        self._outbox.put(line)

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the child's group, unless the child has been reaped (its pid, as a group id, may be reused)."""
        with self._reap_lock:
            if not self._reaped:
                kill_group(self.popen.pid, sig)

    def _watch(self, from_child: int) -> None:
        """The watcher thread: hands the child's lines to the pool and, once the child dies, reaps its group."""
        pidfd = os.pidfd_open(self.popen.pid)
        problem = ""
        try:
            problem = self._read_lines(from_child, pidfd)
        finally:
            with self._reap_lock:  # the group dies with the child: no process it started outlives it
                kill_group(self.popen.pid)
                await_group(self.popen.pid)
                code = self.popen.wait()
                self._reaped = True
            os.close(pidfd)
            os.close(from_child)
            self._outbox.put(None)
            self.listener.on_death(self, code, problem)
            self.loaded.set()

    def _read_lines(self, from_child: int, pidfd: int) -> str:
        """Handle the child's lines until it exits or misbehaves; what it did wrong, if anything (else "")."""
        buffer = b""
        deadline = time.monotonic() + _LOAD_TIMEOUT
        while True:
            wait = None if self.loaded.is_set() else max(0.0, deadline - time.monotonic())
            readable = ready([from_child, pidfd], wait)
            if not readable:
                return f"; it did not load within {_LOAD_TIMEOUT:g} s"
            if from_child not in readable:  # exited, and all it wrote is read
                return ""
            chunk = os.read(from_child, 1 << 16)
            if not chunk:  # the child closes its end as it exits; if it lives on, it closed the pipe itself
                return "" if ready([pidfd], 1.0) else "; it closed its protocol pipe"
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > MAX_LINE:
                return f"; it sent a line longer than {MAX_LINE} bytes"
            for line in lines:
                if problem := self._on_line(line):
                    return f"; {problem}"

    def _on_line(self, line: bytes) -> str | None:
        """Act on one line from the child: its hello, or a call's reply; what is wrong with it, if anything."""
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return "it sent a line that is not JSON"
        if not self.loaded.is_set():
            return self._on_hello(message)
        try:
            key, reply = _parse_reply(message)
        except ValueError as exc:
            return f"it sent a malformed reply ({exc})"
        return self.listener.on_reply(self, key, reply)

    def _on_hello(self, message: Any) -> str | None:
        if message == {"ready": True}:
            self.listener.on_ready(self)
            self.loaded.set()
            return None
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            self.load_error = one_line(message["error"])  # it exits next: the pool words the rest
            return None
        return "it sent a malformed hello"


def _parse_reply(message: Any) -> tuple[int, Reply]:
    """(call id, reply) from a child's message, checked as untrusted input (the value's type is the caller's to
    check)."""
    if not isinstance(message, dict) or type(message.get("id")) is not int:
        raise ValueError("no call id")
    if "error" in message:
        if not isinstance(message["error"], str):
            raise ValueError("an error that is not a string")
        return message["id"], Reply(error=one_line(message["error"]))
    if "value" not in message:
        raise ValueError("neither a value nor an error")
    return message["id"], Reply(value=message["value"])


def _feed(fd: int, lines: queue.SimpleQueue[bytes | None]) -> None:
    """The writer thread: sends queued lines until the None that its watcher queues once the child is dead."""
    while (line := lines.get()) is not None:
        try:
            write_all(fd, line)
        except OSError:  # the child is gone; its watcher says why
            break
    os.close(fd)
