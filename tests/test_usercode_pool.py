"""FunctionPool against real child processes: each guarantee is tried by a user function that breaks it.

Calls are awaited on event loops in background threads, as the rollout's runner awaits them, or made from sync code
through `map`, as the reward manager makes them. Concurrency is proved by calls that can only finish together (a
barrier), never by timing.
"""

from __future__ import annotations

import asyncio
import functools
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from process_checks import gather_on, gone, processes_mentioning, started_from_source

from shardrl.usercode.pool import CallResult, FunctionPool
from shardrl.usercode.wire import MAX_LINE, LoadError

pytestmark = pytest.mark.timeout(60)

MakePool = Callable[..., FunctionPool]


@pytest.fixture
def make_pool(tmp_path: Path) -> Iterator[MakePool]:
    """Write `source` as tmp_path/user.py and start a pool of one process on its `function` (unless `options` say
    otherwise); every pool is closed afterwards."""
    build = functools.partial(FunctionPool, num_processes=1, timeout=30.0, max_concurrent_per_process=4)
    with started_from_source(tmp_path / "user.py", "fn", build) as make:
        yield make


def call_on(loop: asyncio.AbstractEventLoop, pool: FunctionPool, *args: Any) -> list[CallResult]:
    """`pool.call(arg)` for each of `args`, at once on `loop` (in its thread); their results in order."""
    return gather_on(loop, *(pool.call(arg) for arg in args))


def test_arguments_and_values_cross_as_json_unchecked(make_pool: MakePool) -> None:
    """`fn(*args)` gets numpy arguments as plain JSON; whatever JSON value it returns comes back as it is (checking
    it is the caller's job), numpy values included; an exception or a value JSON cannot carry is the call's error."""
    pool = make_pool("""
        import numpy as np

        def fn(kind, payload=None):
            if kind == "raise":
                raise KeyError("missing")
            if kind == "set":
                return {1, 2}
            if kind == "numpy":
                return {"score": np.float32(0.5), "ids": np.arange(3)}
            return [kind, payload]
    """)
    results = pool.map([("echo", {"answer": np.int64(4), "rows": np.array([[1.5, 2.0]])}), ("text", None),
                        ("numpy",), ("raise",), ("set",), (True, float("nan"))])
    echo, text, numpy, raised, unfit, odd = results
    assert echo == CallResult(["echo", {"answer": 4, "rows": [[1.5, 2.0]]}], seconds=echo.seconds)
    assert (text.value, numpy.value) == (["text", None], {"score": 0.5, "ids": [0, 1, 2]})
    assert (raised.value, raised.error) == (None, "KeyError: 'missing'")
    assert unfit.error == "fn returned set {1, 2}, which JSON cannot carry"
    assert odd.value[0] is True and np.isnan(odd.value[1])
    assert pool.stats() == {"calls": 6, "failed": 2, "timed_out": 0, "crashed": 0, "restarts": 0}


def test_arguments_json_cannot_carry_are_refused(make_pool: MakePool) -> None:
    """Unfit data is the caller's bug, not the function's failure: call raises."""
    pool = make_pool("def fn(x):\n    return x\n")
    with pytest.raises(TypeError, match="cannot carry a set"):
        asyncio.run(pool.call({1, 2}))
    assert pool.stats()["calls"] == 0


def test_a_value_too_long_to_cross_is_the_calls_error(make_pool: MakePool) -> None:
    pool = make_pool("def fn(size):\n    return 'x' * size\n")
    too_long, short = pool.map([(MAX_LINE,), (3,)])
    assert re.fullmatch(rf"fn returned \d+ bytes of JSON; at most {MAX_LINE} can cross", too_long.error)
    assert short.value == "xxx" and pool.stats()["restarts"] == 0


def test_map_runs_from_a_thread_that_runs_an_event_loop(make_pool: MakePool) -> None:
    pool = make_pool("async def fn(x):\n    return x * 2\n")

    async def inside_a_loop() -> list[CallResult]:
        return pool.map([(1,), (2,)])
    assert [r.value for r in asyncio.run(inside_a_loop())] == [2, 4]


def test_the_modules_children_import_load_no_numpy() -> None:
    """The children import these: they stay standard-library only, so the children start fast."""
    code = ("import sys, shardrl.usercode.child, shardrl.usercode.pool; "
            "print(sorted({'numpy', 'torch'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("function", ["fn", "async_fn"])
def test_calls_run_at_once_within_one_process(make_pool: MakePool, loops: Callable, function: str) -> None:
    """Four calls that each wait for all four: they finish only if one process runs them at the same time."""
    pool = make_pool("""
        import asyncio, os, threading

        barrier = threading.Barrier(4, timeout=10)
        arrived = 0

        def fn(index):
            barrier.wait()
            return os.getpid()

        async def async_fn(index):
            global arrived
            arrived += 1
            while arrived < 4:
                await asyncio.sleep(0.01)
            return os.getpid()
    """, function, max_concurrent_per_process=4)
    results = call_on(loops(), pool, *range(4))
    assert [r.error for r in results] == [None] * 4
    assert len({r.value for r in results}) == 1


def test_calls_spread_over_processes_from_two_loops(make_pool: MakePool, loops: Callable, tmp_path: Path) -> None:
    """Two calls, each awaited on its own loop, that finish only once both processes hold one: the pool sends each
    to the least-loaded process, though either process could take both."""
    pool = make_pool(f"""
        import os, time
        from pathlib import Path

        def fn(index):
            here = Path({str(tmp_path)!r}) / "pids"
            here.mkdir(exist_ok=True)
            (here / str(os.getpid())).touch()
            while len(list(here.iterdir())) < 2:
                time.sleep(0.01)
            return os.getpid()
    """, num_processes=2, max_concurrent_per_process=4)
    futures = [asyncio.run_coroutine_threadsafe(pool.call(i), loops()) for i in range(2)]
    results = [future.result(timeout=30) for future in futures]
    assert [r.error for r in results] == [None, None]
    assert len({r.value for r in results}) == 2


def test_a_timed_out_async_call_is_cancelled(make_pool: MakePool, loops: Callable, tmp_path: Path) -> None:
    """The process is told to cancel the task: its cleanup runs, and the next call (same process) sees that."""
    marker = tmp_path / "cancelled"
    pool = make_pool(f"""
        import asyncio, os

        async def fn(index):
            if index == 0:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    open({str(marker)!r}, "w").close()
                    raise
            for _ in range(500):
                if os.path.exists({str(marker)!r}):
                    return 1.0
                await asyncio.sleep(0.01)
            return 0.0
    """, timeout=0.5)
    loop = loops()
    [slow] = call_on(loop, pool, 0)
    assert slow.timed_out and slow.error == f"user function {pool.target} timed out after 0.5 s"
    assert [r.value for r in call_on(loop, pool, 1)] == [1.0]


def test_abandoned_threads_that_fill_a_process_get_it_replaced(make_pool: MakePool, loops: Callable) -> None:
    pool = make_pool("""
        import os, threading

        def fn(hang):
            if hang:
                threading.Event().wait()
            return os.getpid()
    """, max_concurrent_per_process=2, timeout=0.5)
    loop = loops()
    [before] = call_on(loop, pool, False)
    assert all(r.timed_out for r in call_on(loop, pool, True, True))
    [after] = call_on(loop, pool, False)
    assert after.error is None and after.value != before.value
    assert gone(before.value)
    assert pool.stats() == {"calls": 4, "failed": 2, "timed_out": 2, "crashed": 0, "restarts": 1}


def test_a_crash_leaves_nothing_it_started_running(make_pool: MakePool, loops: Callable, tmp_path: Path) -> None:
    """The whole group of a process that dies goes with it, before its calls are answered."""
    pid_file = tmp_path / "grandchild"
    pool = make_pool(f"""
        import os, subprocess, sys

        def fn(index):
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open({str(pid_file)!r}, "w") as file:
                file.write(str(sleeper.pid))
            os._exit(3)
    """)
    [crashed] = call_on(loops(), pool, 0)
    assert crashed.error.startswith("user process died (exit code 3)")
    assert gone(int(pid_file.read_text()))


def test_a_process_that_forges_protocol_lines_is_replaced(make_pool: MakePool, loops: Callable) -> None:
    """What a child writes to its protocol pipe is untrusted: a line that is no JSON reply ends that process."""
    pool = make_pool("""
        import os, sys

        def fn(index):
            if index == 0:
                os.write(int(sys.argv[2]), b"not json\\n")  # the pipe to the parent
                return 5.0
            return 1.0
    """)
    loop = loops()
    [forged] = call_on(loop, pool, 0)
    assert forged.value is None and "not JSON" in forged.error
    assert [r.value for r in call_on(loop, pool, 1)] == [1.0]
    assert pool.stats()["restarts"] == 1


def test_a_memory_bomb_fails_only_its_call(make_pool: MakePool, loops: Callable) -> None:
    pool = make_pool("""
        import resource

        def fn(index):
            if index == 1:
                return len(bytearray(8 << 30))
            return resource.getrlimit(resource.RLIMIT_AS)[0] >> 20
    """, memory_limit_mb=512)
    loop = loops()
    limit, bomb = call_on(loop, pool, 0, 1)
    assert limit.value == 512
    assert bomb.value is None and "MemoryError" in bomb.error
    assert [r.value for r in call_on(loop, pool, 2, 3, 4)] == [512] * 3


def test_a_failed_start_leaves_no_process_that_did_load(tmp_path: Path) -> None:
    """Only the first of three processes loads the module: start() fails, and ends the one that loaded too."""
    (tmp_path / "user.py").write_text(textwrap.dedent(f"""
        import os
        os.close(os.open({str(tmp_path / "first")!r}, os.O_CREAT | os.O_EXCL))  # FileExistsError for the others

        def fn(index):
            return 1.0
    """))
    pool = FunctionPool("user.py:fn", num_processes=3, timeout=30, max_concurrent_per_process=1,
                        base_dir=str(tmp_path), label="reward")
    with pytest.raises(LoadError, match=f"^cannot load reward function {tmp_path}/user.py:fn: FileExistsError"):
        pool.start()
    assert processes_mentioning(str(tmp_path)) == []


def test_a_module_target_loads_from_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_functions.py").write_text("def fn(x):\n    return x + 1\n")
    monkeypatch.chdir(tmp_path)  # the children start in the caller's cwd, which `python -m` puts on their path
    pool = FunctionPool("my_functions:fn", num_processes=1, timeout=30, max_concurrent_per_process=1)
    try:
        pool.start()
        assert asyncio.run(pool.call(41)).value == 42
    finally:
        pool.close()


def test_close_leaves_nothing_running(make_pool: MakePool, loops: Callable, tmp_path: Path) -> None:
    """Not the processes, nor what a function started and left running; a call in flight is answered."""
    pid_file, running = tmp_path / "grandchild", tmp_path / "running"
    pool = make_pool(f"""
        import os, subprocess, sys, time

        def fn(index):
            if index == 0:
                while not os.path.exists({str(running)!r}):  # call 1 is in flight on the other process
                    time.sleep(0.01)
                sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                with open({str(pid_file)!r}, "w") as file:
                    file.write(str(sleeper.pid))
                return os.getpid()
            open({str(running)!r}, "w").close()
            time.sleep(60)
    """, num_processes=2)
    loop = loops()
    in_flight = asyncio.run_coroutine_threadsafe(pool.call(1), loop)
    [spawner] = call_on(loop, pool, 0)
    children = {spawner.value, int(pid_file.read_text())}
    assert not any(gone(pid) for pid in children)
    pool.close()
    assert in_flight.result(timeout=10).error == "the user host closed while the call ran"
    assert all(gone(pid) for pid in children)
    assert processes_mentioning(str(tmp_path)) == []
    pool.close()  # idempotent
    assert asyncio.run(pool.call(2)).error == "the user host is closed"
