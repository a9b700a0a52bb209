"""The child side of a FunctionPool: `python -m shardrl.usercode.child FROM_PARENT TO_PARENT CAPACITY MEMORY_MB
TARGET [WRAPPER]`.

It loads the target, says so (or why not) on its pipe to the parent, then runs calls as the parent sends them: an
async function as tasks on its event loop, a sync one in a pool of CAPACITY threads. Each reply is one JSON line;
the user's prints go to stderr, never into the protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import os
import reprlib
import resource
import sys
import threading
from typing import Any, Callable

from shardrl.usercode.procs import kill_group
from shardrl.usercode.wire import MAX_LINE, LoadError, describe, encode, is_file_target, write_all


def main(argv: list[str]) -> None:
    from_parent, to_parent, capacity, memory_mb, arity = map(int, argv[:5])
    target, wrappers = argv[5], argv[6:]
    os.dup2(2, 1)  # the user's prints go to stderr: the protocol has pipes of its own
    sys.stdout.reconfigure(line_buffering=True)
    for fd in (from_parent, to_parent):
        os.set_inheritable(fd, False)  # nothing the user's function executes gets them
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    try:
        function = _load(target)
        if arity:
            _check_arity(function, target, arity)
    except LoadError as exc:
        write_all(to_parent, encode({"error": str(exc)}))
        return
    for wrapper in wrappers:  # shardrl's own code: a failure here is a bug, reported as the process's death
        function = _load(wrapper)(function)
    write_all(to_parent, encode({"ready": True}))
    asyncio.run(_serve(_Calls(function, target.rpartition(":")[2], capacity, to_parent), from_parent))


def _load(target: str) -> Callable[..., Any]:
    """The function `target` names; LoadError saying why not (the parent adds which function it was)."""
    where, _, name = target.rpartition(":")
    try:
        module = _import_file(where) if is_file_target(where) else importlib.import_module(where)
    except BaseException as exc:  # the user's module runs at import: whatever it raises is a load failure
        raise LoadError(describe(exc)) from None
    if not hasattr(module, name):
        raise LoadError(f"{where} has no attribute {name!r}")
    function = getattr(module, name)
    if not callable(function):
        raise LoadError(f"{name} is a {type(function).__name__}, not a function")
    return function


def _check_arity(function: Callable[..., Any], target: str, arity: int) -> None:
    """LoadError unless `function` can be called with `arity` positional arguments (how every call passes them)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or extension without one: its calls will tell
        return
    try:
        signature.bind(*range(arity))
    except TypeError:
        raise LoadError(f"{target.rpartition(':')[2]}{signature} cannot take the {arity} positional arguments "
                        f"each call passes") from None


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path}")
    sys.path.insert(0, os.path.dirname(path))  # its helper modules import as they would if it ran as a script
    spec = importlib.util.spec_from_file_location("shardrl_user_function", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickle look a module up by name
    spec.loader.exec_module(module)
    return module


async def _serve(calls: _Calls, from_parent: int) -> None:
    """Start and cancel calls as the parent says, for as long as this process lives."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    threading.Thread(target=_read_parent, args=(from_parent, loop, inbox), daemon=True).start()
    while True:
        message = await inbox.get()
        if message["op"] == "call":
            calls.start(message["id"], message["args"])
        else:
            calls.cancel(message["id"])


def _read_parent(fd: int, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[dict[str, Any]]) -> None:
    """A thread of its own, so that the parent's going is noticed even while the user's code blocks the loop."""
    with open(fd, "rb") as pipe:
        for line in pipe:
            loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))
    kill_group(0)  # the parent closed or died: nothing of this group may outlive it


class _Calls:
    """The calls running in this process: async ones as tasks on its loop, sync ones in a pool of threads."""

    def __init__(self, function: Callable[..., Any], name: str, capacity: int, to_parent: int) -> None:
        self.function = function
        self.name = name  # the user's, for errors (`function` may be a wrapper around it)
        self.is_async = inspect.iscoroutinefunction(function)
        self.threads = None if self.is_async else concurrent.futures.ThreadPoolExecutor(capacity, "usercode")
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.to_parent = to_parent

    def start(self, key: int, args: list[Any]) -> None:
        self.tasks[key] = asyncio.get_running_loop().create_task(self._run(key, args))

    def cancel(self, key: int) -> None:
        if self.is_async and key in self.tasks:  # a thread cannot be stopped: it answers when it ends
            self.tasks[key].cancel()

    async def _run(self, key: int, args: list[Any]) -> None:
        try:
            if self.is_async:
                value = await self.function(*args)
            else:
                value = await asyncio.get_running_loop().run_in_executor(self.threads, self.function, *args)
            line = self._encode(key, value)
        except asyncio.CancelledError:
            line = encode({"id": key, "error": "cancelled"})
        except BaseException as exc:  # the user's code: whatever it raises is this call's failure
            line = encode({"id": key, "error": describe(exc)})
        del self.tasks[key]
        write_all(self.to_parent, line)

    def _encode(self, key: int, value: Any) -> bytes:
        """The reply line for `value`, or an error line if it cannot cross (not JSON, or too long)."""
        try:
            line = encode({"id": key, "value": value})
        except (TypeError, ValueError, RecursionError):
            return encode({"id": key, "error": f"{self.name} returned {type(value).__name__} "
                                               f"{reprlib.repr(value)}, which JSON cannot carry"})
        if len(line) > MAX_LINE:
            return encode({"id": key, "error": f"{self.name} returned {len(line)} bytes of JSON; at most "
                                               f"{MAX_LINE} can cross"})
        return line


if __name__ == "__main__":
    main(sys.argv[1:])
