"""Run user agent functions in a pool of child processes, so that nothing they do can reach the trainer's process.

An agent function is the user's own program for one episode: it talks to the policy through the OpenAI-compatible
endpoint that shardrl serves for that episode (`AgentEpisode.base_url`) and returns a reward, or None to leave the
scoring to the run's reward function. It is arbitrary code: it may raise, hang, leak memory, crash the interpreter
or start processes of its own. `AgentHost` runs it in `num_processes` children (what verl's
`actor_rollout_ref.rollout.agent.num_workers` counts: agent worker processes), each in a session of its own, and
guarantees:

- whatever the function does, `run` returns an `EpisodeResult` at most `episode_timeout` after the episode reached a
  process: an exception, a value that is no reward, a timeout or the death of the process (os._exit, a segfault,
  the memory limit) becomes that episode's one-line error;
- a process that dies fails only the episodes it held, and a fresh one takes its place;
- `close()` leaves nothing running: each child's process group (all it started there, unless it left the group with
  setsid) is killed, and waited for;
- nothing from a child is unpickled: parent and children exchange JSON lines over pipes of their own, and the
  children's stdout and stderr (the user's prints) go to the trainer's stderr.

The one limit: a sync function's thread cannot be stopped. On a timeout it is abandoned and runs on until its process
is replaced, which happens once abandoned episodes fill all `max_episodes_per_process` slots of that process; the
endpoint behind the episode's base_url must refuse its further requests (the caller arranges that).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import queue
import reprlib
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

_LOAD_TIMEOUT = 120.0  # seconds a child may take to import the target (user modules may import heavy packages)
_CLOSE_GRACE = 2.0  # seconds between SIGTERM and SIGKILL at close()
_KILL_WAIT = 5.0  # seconds to wait for SIGKILLed processes to be gone (one stuck in the kernel may take longer)
_MAX_LINE = 1 << 20  # bytes: a longer line from a child is refused, so it cannot grow our memory without bound
_MAX_ERROR = 500  # characters kept of an error message


class AgentHostError(ValueError):
    """The agent function cannot be loaded (bad target, import error, not callable): one line naming the target."""


@dataclass(frozen=True)
class AgentEpisode:
    """What the user's function receives (plain data; it crosses a process boundary as JSON)."""

    base_url: str  # e.g. "http://127.0.0.1:PORT/v1", already specific to this episode
    api_key: str
    model: str
    messages: list[dict[str, Any]]  # the sample's chat prompt
    tools: list[dict[str, Any]]  # OpenAI function schemas configured for the run (may be empty)
    extra_info: dict[str, Any]  # the data row's extra_info
    max_tokens: int  # the episode's whole response budget in tokens
    index: int  # a number unique within the run, for the user's logs


@dataclass(frozen=True)
class EpisodeResult:
    reward: float | None = None
    error: str | None = None  # one line: "<ExceptionType>: <message>" or why the episode failed
    timed_out: bool = False
    seconds: float = 0.0


class _Reply(NamedTuple):
    reward: float | None = None
    error: str | None = None
    crashed: bool = False  # lost with its process


class _Pending(NamedTuple):
    loop: asyncio.AbstractEventLoop  # the caller's: the episode's future is settled on it
    future: asyncio.Future[_Reply]


class _Process:
    """One child and the episodes it holds; `state`, `pending` and `abandoned` change only under the host's lock."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.state = "starting"  # -> "live" once it loaded the target (-> "retiring" when stuck) -> "dead"
        self.loaded = threading.Event()  # set once it is live or dead
        self.load_error: str | None = None
        self.pending: dict[int, _Pending] = {}  # episodes it runs (abandoned ones too, until they end)
        self.abandoned: set[int] = set()  # timed out or cancelled: their callers have had their answer
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.reap_lock = threading.Lock()  # signals go to its group only while its pid cannot have been reused
        self.reaped = False
        self.watcher: threading.Thread | None = None


class AgentHost:
    """A pool of processes running one agent function; `run` may be awaited from event loops in any threads.

    `target` is "package.module:function" (imported from the children's sys.path, the trainer's cwd first) or
    "path/to/file.py:function" (relative to `base_dir`, default the cwd). Each process runs up to
    `max_episodes_per_process` episodes at once. `memory_limit_mb` caps each process's address space (RLIMIT_AS),
    thread stacks included (8 MiB each): leave room for that many threads when the function is sync.
    """

    def __init__(self, target: str, *, num_processes: int = 8, episode_timeout: float = 600.0,
                 max_episodes_per_process: int = 64, memory_limit_mb: int | None = None,
                 base_dir: str | None = None) -> None:
        for name, value in (("num_processes", num_processes), ("episode_timeout", episode_timeout),
                            ("max_episodes_per_process", max_episodes_per_process),
                            ("memory_limit_mb", memory_limit_mb)):
            if value is not None and value <= 0:
                raise ValueError(f"AgentHost {name} must be positive, got {value!r}")
        self.target = _resolve_target(target, base_dir)
        self.num_processes = num_processes
        self.episode_timeout = episode_timeout
        self.max_episodes_per_process = max_episodes_per_process
        self.memory_limit_mb = memory_limit_mb
        self._lock = threading.Lock()
        self._processes: list[_Process] = []
        self._waiters: deque[_Pending] = deque()  # callers waiting for a free slot
        self._keys = itertools.count()
        self._started = self._closed = False
        self._last_load_error = ""
        self._stats = dict.fromkeys(("episodes", "failed", "timed_out", "crashed", "restarts"), 0)

    def start(self) -> None:
        """Start the processes and wait until each has loaded the function; AgentHostError (none left) if one fails."""
        with self._lock:
            if self._started:
                raise RuntimeError("AgentHost.start() was already called")
            self._started = True
        try:
            with self._lock:
                children = [self._spawn() for _ in range(self.num_processes)]
        except OSError:
            self.close()
            raise
        for child in children:
            child.loaded.wait()  # its watcher sets it by _LOAD_TIMEOUT at the latest
        errors = [child.load_error for child in children if child.load_error is not None]
        if errors:
            self.close()
            raise AgentHostError(errors[0])

    async def run(self, episode: AgentEpisode) -> EpisodeResult:
        """Run one episode on the least-loaded process; whatever the agent function does comes back as the result."""
        if not self._started:
            raise RuntimeError("call AgentHost.start() before AgentHost.run()")
        body = json.dumps(vars(episode), default=_to_json, separators=(",", ":"))  # a TypeError for unfit data
        slot = await self._acquire(asyncio.get_running_loop())
        if isinstance(slot, str):
            return self._count(EpisodeResult(error=slot))
        child, key, future = slot
        start = time.monotonic()
        child.outbox.put(f'{{"op":"run","id":{key},"episode":{body}}}\n'.encode())
        try:
            reply = await asyncio.wait_for(future, self.episode_timeout)
        except TimeoutError:
            self._abandon(child, key)
            return self._count(EpisodeResult(error=f"agent function {self.target} timed out after "
                                                   f"{self.episode_timeout:g} s", timed_out=True,
                                             seconds=time.monotonic() - start))
        except asyncio.CancelledError:
            self._abandon(child, key)
            raise
        return self._count(EpisodeResult(reply.reward, reply.error, seconds=time.monotonic() - start), reply.crashed)

    def stats(self) -> dict[str, int]:
        """Counts since start: episodes returned, failed (timeouts and crashes included), timed_out, crashed (lost
        with a dead process), restarts (processes started in place of dead or stuck ones)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """End every process and what it started in its group: SIGTERM, SIGKILL after a short grace. Idempotent."""
        with self._lock:
            self._closed = True
            children = list(self._processes)
            self._wake(None)
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + _CLOSE_GRACE
        for child in children:
            child.watcher.join(max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.watcher.is_alive():
                _signal_group(child, signal.SIGKILL)
                child.watcher.join()

    # ---- the parent side: dispatch (on the callers' loops) ----

    async def _acquire(self, loop: asyncio.AbstractEventLoop) -> tuple[_Process, int, asyncio.Future[_Reply]] | str:
        """A slot on the least-loaded live process, waiting while all are full; the reason why not if none will come."""
        while True:
            with self._lock:
                if self._closed:
                    return "the agent host is closed"
                if not self._processes:
                    return f"no agent process is running: {self._last_load_error}"
                free = [c for c in self._processes
                        if c.state == "live" and len(c.pending) < self.max_episodes_per_process]
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

    def _abandon(self, child: _Process, key: int) -> None:
        """The caller has its answer; ask the child to cancel, and replace it once abandoned episodes fill it."""
        with self._lock:
            if key not in child.pending:  # it answered meanwhile
                return
            child.abandoned.add(key)
            stuck = child.state == "live" and len(child.abandoned) >= self.max_episodes_per_process
            if stuck:
                child.state = "retiring"  # no new episodes: they would die with it
        child.outbox.put(f'{{"op":"cancel","id":{key}}}\n'.encode())
        if stuck:  # its watcher sees the death and starts a replacement; nothing it held is awaited any more
            _signal_group(child, signal.SIGKILL)

    def _count(self, result: EpisodeResult, crashed: bool = False) -> EpisodeResult:
        with self._lock:
            self._stats["episodes"] += 1
            self._stats["failed"] += result.error is not None
            self._stats["timed_out"] += result.timed_out
            self._stats["crashed"] += crashed
        return result

    def _wake(self, count: int | None) -> None:
        """Wake `count` waiting callers (None: all); the caller holds the lock."""
        while self._waiters and (count is None or count > 0):
            waiter = self._waiters.popleft()
            _settle_from_thread(waiter, None)
            count = None if count is None else count - 1

    # ---- the parent side: the children (spawned under the lock, each served by a watcher and a writer thread) ----

    def _spawn(self) -> _Process:
        """Start one child, in a session of its own (its group is what close() kills), with a pipe each way."""
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        env = None
        if self.memory_limit_mb is not None:  # glibc reserves 64 MiB of address space per thread's arena otherwise
            env = {"MALLOC_ARENA_MAX": "2", **os.environ}
        command = [sys.executable, "-m", __name__, str(from_parent), str(to_parent),
                   str(self.max_episodes_per_process), str(self.memory_limit_mb or 0), self.target]
        try:
            popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(from_parent, to_parent),
                                     start_new_session=True, env=env)
        except OSError:
            os.close(to_child)
            os.close(from_child)
            raise
        finally:  # the child holds these ends now
            os.close(from_parent)
            os.close(to_parent)
        child = _Process(popen)
        child.watcher = threading.Thread(target=self._watch, args=(child, from_child), daemon=True,
                                         name=f"agent-host-watch-{popen.pid}")
        child.watcher.start()
        threading.Thread(target=_feed, args=(to_child, child.outbox), daemon=True,
                         name=f"agent-host-feed-{popen.pid}").start()
        self._processes.append(child)
        return child

    def _watch(self, child: _Process, from_child: int) -> None:
        """The child's watcher thread: settles its episodes and, once it dies, fails those left and replaces it."""
        pidfd = os.pidfd_open(child.popen.pid)
        problem = ""
        try:
            problem = self._read_lines(child, from_child, pidfd)
        finally:
            with child.reap_lock:  # the group dies with the child: no process it started outlives it
                _kill_group(child.popen.pid, signal.SIGKILL)
                _await_group(child.popen.pid)
                code = child.popen.wait()
                child.reaped = True
            os.close(pidfd)
            os.close(from_child)
            child.outbox.put(None)
            self._on_death(child, code, problem)

    def _read_lines(self, child: _Process, from_child: int, pidfd: int) -> str:
        """Handle the child's lines until it exits or misbehaves; what it did wrong, if anything (else "")."""
        buffer = b""
        deadline = time.monotonic() + _LOAD_TIMEOUT
        while True:
            wait = None if child.loaded.is_set() else max(0.0, deadline - time.monotonic())
            ready = _ready([from_child, pidfd], wait)
            if not ready:
                return f"; it did not load within {_LOAD_TIMEOUT:g} s"
            if from_child not in ready:  # exited, and all it wrote is read
                return ""
            chunk = os.read(from_child, 1 << 16)
            if not chunk:  # the child closes its end as it exits; if it lives on, it closed the pipe itself
                return "" if _ready([pidfd], 1.0) else "; it closed its protocol pipe"
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > _MAX_LINE:
                return f"; it sent a line longer than {_MAX_LINE} bytes"
            for line in lines:
                if problem := self._on_line(child, line):
                    return f"; {problem}"

    def _on_line(self, child: _Process, line: bytes) -> str | None:
        """Act on one line from the child: its hello, or an episode's reply; what is wrong with it, if anything."""
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return "it sent a line that is not JSON"
        if not child.loaded.is_set():
            return self._on_hello(child, message)
        try:
            key, reply = _parse_reply(message)
        except ValueError as exc:
            return f"it sent a malformed reply ({exc})"
        with self._lock:
            pending = child.pending.pop(key, None)
            if pending is None:
                return f"it answered episode {key}, which it was not running"
            child.abandoned.discard(key)
            self._wake(1)
        _settle_from_thread(pending, reply)
        return None

    def _on_hello(self, child: _Process, message: Any) -> str | None:
        if message == {"ready": True}:
            with self._lock:
                child.state = "live"
                self._wake(self.max_episodes_per_process)
            child.loaded.set()
            return None
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            child.load_error = _one_line(message["error"])  # it exits next: its watcher reports the rest
            return None
        return "it sent a malformed hello"

    def _on_death(self, child: _Process, code: int, problem: str) -> None:
        """Fail the episodes the dead child held and start its replacement, unless the host is closing."""
        how = _exit_text(code)
        with self._lock:
            self._processes.remove(child)
            was_live, child.state = child.state in ("live", "retiring"), "dead"
            lost = [pending for key, pending in child.pending.items() if key not in child.abandoned]
            child.pending.clear()
            if not was_live:
                child.load_error = child.load_error or (f"agent process for {self.target} died ({how}) before "
                                                        f"loading it{problem}")
                self._last_load_error = child.load_error
            elif not self._closed:
                self._replace()
            if not self._processes:
                self._wake(None)  # no slot will come: the waiting callers get the reason
            closed = self._closed
        child.loaded.set()
        error = ("the agent host closed while the episode ran" if closed
                 else f"agent process died ({how}){problem} with this episode in flight")
        for pending in lost:
            _settle_from_thread(pending, _Reply(error=error, crashed=not closed))

    def _replace(self) -> None:
        try:
            self._spawn()
        except OSError as exc:  # e.g. no memory to fork: the pool goes on one process short
            self._last_load_error = _one_line(f"cannot start a replacement agent process: {exc}")
            return
        self._stats["restarts"] += 1


def _resolve_target(target: str, base_dir: str | None) -> str:
    """The target with its file (if it names one) made absolute, so the children need no base_dir."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise AgentHostError(f"agent function {target!r} must read 'package.module:function' or "
                             f"'path/to/file.py:function'")
    if _is_file(where):
        where = os.path.abspath(os.path.join(base_dir or os.getcwd(), where))
    return f"{where}:{name}"


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def _to_json(value: Any) -> Any:
    """json.dumps's fallback: numpy arrays and scalars (parquet rows hold them) as lists and Python numbers."""
    numpy = sys.modules.get("numpy")  # loaded wherever such values exist; never imported here
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.tolist()
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    raise TypeError(f"an agent episode cannot carry a {type(value).__name__}: only JSON values and numpy arrays")


def _parse_reply(message: Any) -> tuple[int, _Reply]:
    """(episode id, reply) from a child's message, checked as untrusted input."""
    if not isinstance(message, dict) or type(message.get("id")) is not int:
        raise ValueError("no episode id")
    if "error" in message:
        if not isinstance(message["error"], str):
            raise ValueError("an error that is not a string")
        return message["id"], _Reply(error=_one_line(message["error"]))
    reward = message.get("reward", ...)
    if reward is not None and (type(reward) not in (int, float) or not math.isfinite(reward)):
        raise ValueError(f"reward {reprlib.repr(reward)}")
    return message["id"], _Reply(reward=None if reward is None else float(reward))


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # timed out or cancelled meanwhile
        future.set_result(value)


def _settle_from_thread(pending: _Pending, value: Any) -> None:
    try:
        pending.loop.call_soon_threadsafe(_settle, pending.future, value)
    except RuntimeError:  # that loop has closed: nobody awaits the episode any more
        pass


def _feed(fd: int, lines: queue.SimpleQueue[bytes | None]) -> None:
    """The child's writer thread, so that a child that stops reading blocks no caller's event loop."""
    while (line := lines.get()) is not None:
        try:
            _write_all(fd, line)
        except OSError:  # the child is gone; its watcher says why
            break
    os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _ready(fds: list[int], timeout: float | None) -> set[int]:
    """Those of `fds` that can be read (or hit end of file) within `timeout` seconds; poll, unlike select, takes any
    fd number (a trainer may hold over 1024 files)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)}


def _await_group(pgid: int) -> None:
    """Wait until every process of the SIGKILLed group has exited: killpg returns before they are gone."""
    deadline = time.monotonic() + _KILL_WAIT
    for pid in _group_members(pgid):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped meanwhile
            continue
        _ready([pidfd], max(0.0, deadline - time.monotonic()))
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


def _signal_group(child: _Process, sig: signal.Signals) -> None:
    with child.reap_lock:
        if not child.reaped:
            _kill_group(child.popen.pid, sig)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is already gone
        pass


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    return f"exit code {code}: {signal.strsignal(-code) or f'signal {-code}'}"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_MAX_ERROR]


def _describe(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


# ---- the child side: `python -m shardrl.agents.agent_host FROM_PARENT TO_PARENT CAPACITY MEMORY_MB TARGET` ----

def _child_main(argv: list[str]) -> None:
    from_parent, to_parent, capacity, memory_mb = map(int, argv[:4])
    target = argv[4]
    os.dup2(2, 1)  # the user's prints go to stderr: the protocol has pipes of its own
    sys.stdout.reconfigure(line_buffering=True)
    for fd in (from_parent, to_parent):
        os.set_inheritable(fd, False)  # nothing the agent function executes gets them
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    try:
        function = _load(target)
    except AgentHostError as exc:
        _send(to_parent, {"error": str(exc)})
        return
    _send(to_parent, {"ready": True})
    asyncio.run(_serve(function, from_parent, to_parent, capacity))


def _load(target: str) -> Callable[..., Any]:
    where, _, name = target.rpartition(":")
    try:
        module = _import_file(where) if _is_file(where) else importlib.import_module(where)
    except BaseException as exc:  # the user's module runs at import: whatever it raises is a load failure
        raise AgentHostError(f"cannot load agent function {target}: {_describe(exc)}") from None
    if not hasattr(module, name):
        raise AgentHostError(f"cannot load agent function {target}: {where} has no attribute {name!r}")
    function = getattr(module, name)
    if not callable(function):
        raise AgentHostError(f"cannot load agent function {target}: {name} is a {type(function).__name__}, "
                             f"not a function")
    return function


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path}")
    sys.path.insert(0, os.path.dirname(path))  # its helper modules import as they would if it ran as a script
    spec = importlib.util.spec_from_file_location("shardrl_agent_function", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickle look a module up by name
    spec.loader.exec_module(module)
    return module


async def _serve(function: Callable[..., Any], from_parent: int, to_parent: int, capacity: int) -> None:
    """Start and cancel episodes as the parent says, for as long as this process lives."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    threading.Thread(target=_read_parent, args=(from_parent, loop, inbox), daemon=True).start()
    episodes = _Episodes(function, capacity, to_parent)
    while True:
        message = await inbox.get()
        if message["op"] == "run":
            episodes.start(message["id"], AgentEpisode(**message["episode"]))
        else:
            episodes.cancel(message["id"])


def _read_parent(fd: int, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[dict[str, Any]]) -> None:
    """A thread of its own, so that the parent's going is noticed even while the agent code blocks the loop."""
    with open(fd, "rb") as pipe:
        for line in pipe:
            loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))
    os.killpg(0, signal.SIGKILL)  # the parent closed or died: nothing of this group may outlive it


class _Episodes:
    """The episodes running in this process: async ones as tasks on its loop, sync ones in a pool of threads."""

    def __init__(self, function: Callable[..., Any], capacity: int, to_parent: int) -> None:
        self.function = function
        self.name = getattr(function, "__qualname__", type(function).__name__)
        self.is_async = inspect.iscoroutinefunction(function)
        self.threads = None if self.is_async else concurrent.futures.ThreadPoolExecutor(capacity, "agent")
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.to_parent = to_parent

    def start(self, key: int, episode: AgentEpisode) -> None:
        self.tasks[key] = asyncio.get_running_loop().create_task(self._run(key, episode))

    def cancel(self, key: int) -> None:
        if self.is_async and key in self.tasks:  # a thread cannot be stopped: it answers when it ends
            self.tasks[key].cancel()

    async def _run(self, key: int, episode: AgentEpisode) -> None:
        try:
            if self.is_async:
                value = await self.function(episode)
            else:
                value = await asyncio.get_running_loop().run_in_executor(self.threads, self.function, episode)
            reply = _reward_reply(self.name, value)
        except asyncio.CancelledError:
            reply = {"error": "cancelled"}
        except BaseException as exc:  # the user's code: whatever it raises is this episode's failure
            reply = {"error": _describe(exc)}
        del self.tasks[key]
        _send(self.to_parent, {"id": key, **reply})


def _reward_reply(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {"reward": None}
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        return {"reward": float(value)}
    return {"error": _one_line(f"agent function {name} returned {type(value).__name__} {reprlib.repr(value)}; "
                               f"it must return a finite float or int, or None")}


def _send(fd: int, message: dict[str, Any]) -> None:
    _write_all(fd, json.dumps(message).encode() + b"\n")


if __name__ == "__main__":
    from shardrl.agents.agent_host import _child_main as main  # the package's copy: isinstance(AgentEpisode) holds

    main(sys.argv[1:])
