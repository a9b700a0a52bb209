"""Run one untrusted user function in a pool of child processes, so that nothing it does can reach the caller's process.

The function (an agent, a reward function) is arbitrary code: it may raise, hang, leak memory, crash the interpreter
or start processes of its own. `FunctionPool` runs it in `num_processes` children, each in a session of its own,
and guarantees:

- whatever the function does, `call` returns a `CallResult` at most `timeout` after the call reached a process: an
  exception, a timeout or the death of the process (os._exit, a segfault, the memory limit) becomes that call's
  one-line error;
- a process that dies fails only the calls it held, and a fresh one takes its place;
- `close()` leaves nothing running: each child's process group (all it started there, unless it left the group with
  setsid) is killed, and waited for;
- nothing from a child is unpickled: parent and children exchange JSON lines over pipes of their own, and the
  children's stdout and stderr (the user's prints) go to the caller's stderr.

Arguments and the returned value cross as JSON (numpy values as plain JSON); the pool checks nothing about the
value's type: that is its caller's job. The one limit: a sync function's thread cannot be stopped. On a timeout it is
abandoned and runs on until its process is replaced, which happens once abandoned calls fill all
`max_concurrent_per_process` slots of that process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from shardrl.usercode.process import ChildProcess, Reply
from shardrl.usercode.procs import exit_text
from shardrl.usercode.wire import LoadError, encode, one_line, resolve_target

_CLOSE_GRACE = 2.0  # seconds between SIGTERM and SIGKILL at close()


@dataclass(frozen=True)
class CallResult:
    value: Any = None  # what the function returned, as JSON decodes it; None when it failed
    error: str | None = None  # one line: "<ExceptionType>: <message>" or why the call failed
    timed_out: bool = False
    seconds: float = 0.0


class _Pending(NamedTuple):
    loop: asyncio.AbstractEventLoop  # the caller's: the call's future is settled on it
    future: asyncio.Future[Any]


_Slot = tuple[ChildProcess, int, asyncio.Future[Reply]]  # a call's place on a process: (process, call id, its reply)


def check_positive(owner: str, **values: float | None) -> None:
    """ValueError naming the first of `values` (None: unset) that is not positive."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ValueError(f"{owner} {name} must be positive, got {value!r}")


class FunctionPool:
    """A pool of processes running one function; `call` may be awaited from event loops in any threads.

    `target` is "package.module:function" (imported from the children's sys.path, the caller's cwd first) or
    "path/to/file.py:function" (relative to `base_dir`, default the cwd). Each process runs up to
    `max_concurrent_per_process` calls at once: an async function as tasks on its event loop, a sync one in as many
    threads. `memory_limit_mb` caps each process's address space (RLIMIT_AS), thread stacks included (8 MiB each):
    leave room for that many threads when the function is sync. `label` names the function's role in errors
    ("agent": "agent function x.py:f timed out after 5 s"). `wrapper`, a "package.module:function" of shardrl's
    own, is applied to the loaded function in the child (`wrapper(function)` is what gets called), for callers whose
    function takes richer arguments than JSON. `arity`: every call passes that many positional arguments, and a
    function whose signature cannot take them fails to load (0: not checked).
    """

    def __init__(self, target: str, *, num_processes: int, timeout: float, max_concurrent_per_process: int,
                 memory_limit_mb: int | None = None, base_dir: str | None = None, label: str = "user",
                 wrapper: str | None = None, arity: int = 0) -> None:
        check_positive("FunctionPool", num_processes=num_processes, timeout=timeout,
                       max_concurrent_per_process=max_concurrent_per_process, memory_limit_mb=memory_limit_mb)
        self.label = label
        self.target = resolve_target(target, base_dir, label)
        self.num_processes = num_processes
        self.timeout = timeout
        self.max_concurrent_per_process = max_concurrent_per_process
        self._arguments = [str(max_concurrent_per_process), str(memory_limit_mb or 0), str(arity),  # the child's
                           self.target]
        if wrapper is not None:
            self._arguments.append(wrapper)
        # glibc reserves 64 MiB of address space per thread's malloc arena otherwise
        self._env = None if memory_limit_mb is None else {"MALLOC_ARENA_MAX": "2", **os.environ}
        self._lock = threading.Lock()
        self._processes: list[ChildProcess] = []
        self._waiters: deque[_Pending] = deque()  # callers waiting for a free slot
        self._keys = itertools.count()
        self._started = self._closed = False
        self._last_load_error = ""
        self._stats = dict.fromkeys(("calls", "failed", "timed_out", "crashed", "restarts"), 0)

    def start(self) -> None:
        """Start the processes and wait until each has loaded the function; LoadError (none left) if one fails."""
        with self._lock:
            if self._started:
                raise RuntimeError("FunctionPool.start() was already called")
            self._started = True
        try:
            with self._lock:
                children = [self._spawn() for _ in range(self.num_processes)]
        except OSError:
            self.close()
            raise
        for child in children:
            child.loaded.wait()  # its watcher sets it by the load timeout at the latest
        errors = [child.load_error for child in children if child.load_error is not None]
        if errors:
            self.close()
            raise LoadError(errors[0])

    async def call(self, *args: Any) -> CallResult:
        """Call the function with `args` on the least-loaded process; whatever it does comes back as the result.
        A TypeError (the caller's bug, not the function's failure) for arguments JSON cannot carry."""
        if not self._started:
            raise RuntimeError("call FunctionPool.start() before FunctionPool.call()")
        body = encode(list(args))[:-1]  # before a slot is taken: unfit arguments take none
        slot = await self._acquire(asyncio.get_running_loop())
        if isinstance(slot, str):
            return self._count(CallResult(error=slot))
        child, key, future = slot
        start = time.monotonic()
        child.send(b'{"op":"call","id":%d,"args":%s}\n' % (key, body))
        try:
            reply = await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            self._abandon(child, key)
            return self._count(CallResult(error=f"{self.label} function {self.target} timed out after "
                                                f"{self.timeout:g} s", timed_out=True,
                                          seconds=time.monotonic() - start))
        except asyncio.CancelledError:
            self._abandon(child, key)
            raise
        return self._count(CallResult(reply.value, reply.error, seconds=time.monotonic() - start), reply.crashed)

    def map(self, args_list: Sequence[Sequence[Any]]) -> list[CallResult]:
        """`call(*args)` for each of `args_list`, all at once, from synchronous code; their results in order. It runs
        on an event loop of its own in a thread of its own, so the caller's thread may or may not run a loop."""
        async def gather() -> list[CallResult]:
            return list(await asyncio.gather(*(self.call(*args) for args in args_list)))
        return _run_aside(gather())

    def stats(self) -> dict[str, int]:
        """Counts since start: calls returned, failed (timeouts and crashes included), timed_out, crashed (lost with
        a dead process), restarts (processes started in place of dead or stuck ones)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """End every process and what it started in its group: SIGTERM, SIGKILL after a short grace. Idempotent."""
        with self._lock:
            self._closed = True
            children = list(self._processes)
            self._wake(None)
        for child in children:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + _CLOSE_GRACE
        for child in children:
            child.watcher.join(max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.watcher.is_alive():
                child.signal_group(signal.SIGKILL)
                child.watcher.join()

    # ---- dispatch, on the callers' loops ----

    async def _acquire(self, loop: asyncio.AbstractEventLoop) -> _Slot | str:
        """A slot on the least-loaded live process, waiting while all are full; the reason why not if none will come."""
        while True:
            with self._lock:
                if self._closed:
                    return f"the {self.label} host is closed"
                if not self._processes:
                    return f"no {self.label} process is running: {self._last_load_error}"
                free = [c for c in self._processes
                        if c.state == "live" and len(c.pending) < self.max_concurrent_per_process]
                if free:
                    child = min(free, key=lambda c: len(c.pending))
                    key, future = next(self._keys), loop.create_future()
                    child.pending[key] = _Pending(loop, future)
                    return child, key, future
                waiter = _Pending(loop, loop.create_future())
                self._waiters.append(waiter)
            try:
                await waiter.future
            except asyncio.CancelledError:
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    else:  # it had been woken: hand the wake-up on
                        self._wake(1)
                raise

    def _abandon(self, child: ChildProcess, key: int) -> None:
        """The caller has its answer; ask the child to cancel, and replace it once abandoned calls fill it."""
        with self._lock:
            if key not in child.pending:  # it answered meanwhile
                return
            child.abandoned.add(key)
            stuck = child.state == "live" and len(child.abandoned) >= self.max_concurrent_per_process
            if stuck:
                child.state = "retiring"  # no new calls: they would die with it
        child.send(b'{"op":"cancel","id":%d}\n' % key)
        if stuck:  # its watcher sees the death and starts a replacement; nothing it held is awaited any more
            child.signal_group(signal.SIGKILL)

    def _count(self, result: CallResult, crashed: bool = False) -> CallResult:
        with self._lock:
            self._stats["calls"] += 1
            self._stats["failed"] += result.error is not None
            self._stats["timed_out"] += result.timed_out
            self._stats["crashed"] += crashed
        return result

    def _wake(self, count: int | None) -> None:
        """Wake `count` waiting callers (None: all); the caller holds the lock."""
        while self._waiters and (count is None or count > 0):
            _settle_from_thread(self._waiters.popleft(), None)
            count = None if count is None else count - 1

    # ---- the children (spawned under the lock); the on_* methods are called from their watcher threads ----

    def _spawn(self) -> ChildProcess:
        child = ChildProcess(self._arguments, self._env, self)
        self._processes.append(child)
        return child

    def on_ready(self, child: ChildProcess) -> None:
        with self._lock:
            child.state = "live"
            self._wake(self.max_concurrent_per_process)

    def on_reply(self, child: ChildProcess, key: int, reply: Reply) -> str | None:
        with self._lock:
            pending = child.pending.pop(key, None)
            if pending is None:
                return f"it answered call {key}, which it was not running"
            child.abandoned.discard(key)
            self._wake(1)
        _settle_from_thread(pending, reply)
        return None

    def on_death(self, child: ChildProcess, code: int, problem: str) -> None:
        """Fail the calls the dead child held and start its replacement, unless the pool is closing."""
        how = exit_text(code)
        with self._lock:
            self._processes.remove(child)
            was_live, child.state = child.state in ("live", "retiring"), "dead"
            lost = [pending for key, pending in child.pending.items() if key not in child.abandoned]
            child.pending.clear()
            if not was_live:
                reason = (f"cannot load {self.label} function {self.target}: {child.load_error}" if child.load_error
                          else f"{self.label} process for {self.target} died ({how}) before loading it{problem}")
                child.load_error = self._last_load_error = reason
            elif not self._closed:
                self._replace()
            if not self._processes:
                self._wake(None)  # no slot will come: the waiting callers get the reason
            closed = self._closed
        error = (f"the {self.label} host closed while the call ran" if closed
                 else f"{self.label} process died ({how}){problem} with this call in flight")
        for pending in lost:
            _settle_from_thread(pending, Reply(error=error, crashed=not closed))

    def _replace(self) -> None:
        try:
            self._spawn()
        except OSError as exc:  # e.g. no memory to fork: the pool goes on one process short
            self._last_load_error = one_line(f"cannot start a replacement {self.label} process: {exc}")
            return
        self._stats["restarts"] += 1


def _run_aside(coroutine: Coroutine[Any, Any, Any]) -> Any:
    with concurrent.futures.ThreadPoolExecutor(1, "usercode-map") as runner:
        return runner.submit(asyncio.run, coroutine).result()


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # timed out or cancelled meanwhile
        future.set_result(value)


def _settle_from_thread(pending: _Pending, value: Any) -> None:
    try:
        pending.loop.call_soon_threadsafe(_settle, pending.future, value)
    except RuntimeError:  # that loop has closed: nobody awaits the call any more
        pass
