"""AgentHost against real child processes: each guarantee is tried by an agent function that breaks it.

The episodes are awaited on event loops in background threads, as the rollout's runner awaits them. Concurrency is
proved by episodes that can only finish together (a barrier), never by timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shardrl.agents.agent_host import AgentEpisode, AgentHost, AgentHostError, EpisodeResult

pytestmark = pytest.mark.timeout(60)

MakeHost = Callable[..., AgentHost]


def episode(index: int = 0, **extra_info: object) -> AgentEpisode:
    return AgentEpisode(base_url=f"http://127.0.0.1:9/{index}/v1", api_key="key", model="policy",
                        messages=[{"role": "user", "content": "What is 2 + 2?"}],
                        tools=[{"type": "function", "function": {"name": "calc", "parameters": {}}}],
                        extra_info=dict(extra_info), max_tokens=256, index=index)


@pytest.fixture
def loops() -> Iterator[Callable[[], asyncio.AbstractEventLoop]]:
    """Event loops, each running in a thread of its own."""
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


@pytest.fixture
def make_host(tmp_path: Path) -> Iterator[MakeHost]:
    """Write `source` as tmp_path/agent.py and start a host on its `function`; every host is closed afterwards."""
    hosts: list[AgentHost] = []

    def make(source: str, function: str = "agent", **options: object) -> AgentHost:
        (tmp_path / "agent.py").write_text(textwrap.dedent(source))
        host = AgentHost(f"agent.py:{function}", base_dir=str(tmp_path), **options)
        hosts.append(host)
        host.start()
        return host

    yield make
    for host in hosts:
        host.close()


def run_on(loop: asyncio.AbstractEventLoop, host: AgentHost, *episodes: AgentEpisode) -> list[EpisodeResult]:
    """Run the episodes at once on `loop` (in its thread); their results in order."""
    async def run_all() -> list[EpisodeResult]:
        return list(await asyncio.gather(*(host.run(e) for e in episodes)))
    return asyncio.run_coroutine_threadsafe(run_all(), loop).result(timeout=30)


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


def test_sync_and_async_functions_return_rewards(make_host: MakeHost, loops: Callable) -> None:
    source = """
        import asyncio

        def agent(episode):
            return {0: 2, 1: 0.25, 2: None}[episode.index]

        async def async_agent(episode):
            await asyncio.sleep(0)
            return {0: 3, 1: -1.5, 2: None}[episode.index]
    """
    loop = loops()
    sync = run_on(loop, make_host(source, num_processes=1), episode(0), episode(1), episode(2))
    assert [(r.reward, r.error, r.timed_out) for r in sync] == [(2.0, None, False), (0.25, None, False),
                                                                 (None, None, False)]
    assert isinstance(sync[0].reward, float)
    asynchronous = make_host(source, "async_agent", num_processes=1)
    assert [r.reward for r in run_on(loop, asynchronous, episode(0), episode(1), episode(2))] == [3.0, -1.5, None]
    assert asynchronous.stats() == {"episodes": 3, "failed": 0, "timed_out": 0, "crashed": 0, "restarts": 0}


def test_the_episode_arrives_intact_and_prints_do_not_disturb(make_host: MakeHost, tmp_path: Path,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """Every field crosses as sent (numpy values from parquet rows as plain JSON), the function receives the package's
    AgentEpisode, and what it prints (protocol look-alikes too) goes to stderr, not into the protocol."""
    host = make_host("""
        import dataclasses, json, sys
        from shardrl.agents.agent_host import AgentEpisode

        async def agent(episode):
            print('{"id": 0, "reward": 99.0}')
            print('{"id": 0, "reward": 98.0}', file=sys.stderr)
            with open(episode.extra_info["out"], "w") as file:
                json.dump(dataclasses.asdict(episode), file)
            return float(isinstance(episode, AgentEpisode))
    """, num_processes=1)
    out = str(tmp_path / "episode.json")
    sent = episode(7, out=out, answer=np.int64(4), scores=np.array([[1.5, 2.0]]), flag=np.bool_(True), text="ü")
    result = asyncio.run(host.run(sent))
    assert (result.reward, result.error) == (1.0, None)
    out_text, err_text = capfd.readouterr()
    assert "99.0" not in out_text and '{"id": 0, "reward": 99.0}' in err_text  # the trainer's stdout stays its own
    received = json.loads(Path(out).read_text())
    assert received == {"base_url": sent.base_url, "api_key": "key", "model": "policy", "messages": sent.messages,
                        "tools": sent.tools, "max_tokens": 256, "index": 7,
                        "extra_info": {"out": out, "answer": 4, "scores": [[1.5, 2.0]], "flag": True, "text": "ü"}}


def test_the_module_imports_no_numpy() -> None:
    """The children import this module: it stays standard-library only, so they start fast."""
    code = "import sys, shardrl.agents.agent_host; print(sorted({'numpy', 'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_data_json_cannot_carry_is_refused(make_host: MakeHost) -> None:
    """Unfit data is the caller's bug, not the agent function's failure: run raises."""
    host = make_host("def agent(episode):\n    return 1.0\n", num_processes=1)
    with pytest.raises(TypeError, match="cannot carry a set"):
        asyncio.run(host.run(episode(0, labels={1, 2})))
    assert host.stats()["episodes"] == 0


@pytest.mark.parametrize("function", ["agent", "async_agent"])
def test_episodes_run_at_once_within_one_process(make_host: MakeHost, loops: Callable, function: str) -> None:
    """Four episodes that each wait for all four: they finish only if one process runs them at the same time."""
    host = make_host("""
        import asyncio, os, threading

        barrier = threading.Barrier(4, timeout=10)
        arrived = 0

        def agent(episode):
            barrier.wait()
            return os.getpid()

        async def async_agent(episode):
            global arrived
            arrived += 1
            while arrived < 4:
                await asyncio.sleep(0.01)
            return os.getpid()
    """, function, num_processes=1, max_episodes_per_process=4)
    results = run_on(loops(), host, *(episode(i) for i in range(4)))
    assert [r.error for r in results] == [None] * 4
    assert len({r.reward for r in results}) == 1


def test_episodes_spread_over_processes_from_two_loops(make_host: MakeHost, loops: Callable,
                                                       tmp_path: Path) -> None:
    """Two episodes, each awaited on its own loop, that finish only once both processes hold one: the host sends
    each to the least-loaded process, though either process could take both."""
    host = make_host(f"""
        import os, time
        from pathlib import Path

        def agent(episode):
            here = Path({str(tmp_path)!r}) / "pids"
            here.mkdir(exist_ok=True)
            (here / str(os.getpid())).touch()
            while len(list(here.iterdir())) < 2:
                time.sleep(0.01)
            return os.getpid()
    """, num_processes=2, max_episodes_per_process=4)
    first, second = loops(), loops()
    futures = [asyncio.run_coroutine_threadsafe(host.run(episode(i)), loop) for i, loop in enumerate((first, second))]
    results = [future.result(timeout=30) for future in futures]
    assert [r.error for r in results] == [None, None]
    assert len({r.reward for r in results}) == 2


def test_an_exception_is_the_episodes_error(make_host: MakeHost, loops: Callable) -> None:
    host = make_host("""
        import sys

        def agent(episode):
            if episode.index == 1:
                raise ValueError("bad input\\non two lines")
            if episode.index == 2:
                sys.exit(4)
            return 1
    """, num_processes=1)
    results = run_on(loops(), host, episode(0), episode(1), episode(2), episode(3))
    assert [(r.reward, r.error) for r in results] == [(1.0, None), (None, "ValueError: bad input on two lines"),
                                                      (None, "SystemExit: 4"), (1.0, None)]
    assert host.stats()["failed"] == 2 and host.stats()["restarts"] == 0


@pytest.mark.parametrize("returned, type_name", [("'yes'", "str"), ("float('nan')", "float"),
                                                 ("float('inf')", "float"), ("True", "bool"), ("[1.0]", "list")])
def test_a_value_that_is_no_reward_is_an_error(make_host: MakeHost, returned: str, type_name: str) -> None:
    host = make_host(f"""
        async def agent(episode):
            return {returned}
    """, num_processes=1)
    result = asyncio.run(host.run(episode()))
    assert result.reward is None
    assert result.error.startswith(f"agent function agent returned {type_name} "), result.error


def test_a_timeout_answers_while_a_quick_episode_succeeds(make_host: MakeHost, loops: Callable) -> None:
    host = make_host("""
        import time

        def agent(episode):
            if episode.index == 0:
                time.sleep(60)
            return 1.0
    """, num_processes=1, episode_timeout=1.0)
    slow, quick = run_on(loops(), host, episode(0), episode(1))
    assert slow.timed_out and slow.reward is None and slow.error.endswith("timed out after 1 s"), slow
    assert (quick.reward, quick.error, quick.timed_out) == (1.0, None, False)
    assert host.stats() == {"episodes": 2, "failed": 1, "timed_out": 1, "crashed": 0, "restarts": 0}


def test_a_timed_out_async_episode_is_cancelled(make_host: MakeHost, loops: Callable, tmp_path: Path) -> None:
    """The process is told to cancel the task: its cleanup runs, and the next episode (same process) sees that."""
    marker = tmp_path / "cancelled"
    host = make_host(f"""
        import asyncio, os

        async def agent(episode):
            if episode.index == 0:
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
    """, num_processes=1, episode_timeout=0.5)
    loop = loops()
    [slow] = run_on(loop, host, episode(0))
    assert slow.timed_out
    assert [r.reward for r in run_on(loop, host, episode(1))] == [1.0]


def test_abandoned_threads_that_fill_a_process_get_it_replaced(make_host: MakeHost, loops: Callable) -> None:
    host = make_host("""
        import os, threading

        def agent(episode):
            if episode.extra_info.get("hang"):
                threading.Event().wait()
            return os.getpid()
    """, num_processes=1, max_episodes_per_process=2, episode_timeout=0.5)
    loop = loops()
    [before] = run_on(loop, host, episode(0))
    assert all(r.timed_out for r in run_on(loop, host, episode(1, hang=True), episode(2, hang=True)))
    [after] = run_on(loop, host, episode(3))
    assert after.error is None and after.reward != before.reward
    assert gone(int(before.reward))
    assert host.stats() == {"episodes": 4, "failed": 2, "timed_out": 2, "crashed": 0, "restarts": 1}


def test_a_crash_fails_the_episodes_in_flight_and_the_pool_recovers(make_host: MakeHost, loops: Callable) -> None:
    host = make_host("""
        import os, threading, time

        running = threading.Event()

        def agent(episode):
            if episode.index == 0:
                running.set()
                time.sleep(60)
            if episode.index == 1:
                running.wait(10)  # the other episode is in flight on this process now
                os._exit(3)
            return os.getpid()
    """, num_processes=1)
    loop = loops()
    in_flight, crashed = run_on(loop, host, episode(0), episode(1))
    for result in (in_flight, crashed):
        assert result.reward is None and result.error.startswith("agent process died (exit code 3)"), result
    [later] = run_on(loop, host, episode(2))
    assert later.error is None and later.reward > 0
    assert host.stats() == {"episodes": 3, "failed": 2, "timed_out": 0, "crashed": 2, "restarts": 1}


def test_a_crash_leaves_nothing_it_started_running(make_host: MakeHost, loops: Callable, tmp_path: Path) -> None:
    """The whole group of a process that dies goes with it, before its episodes are answered."""
    pid_file = tmp_path / "grandchild"
    host = make_host(f"""
        import os, subprocess, sys

        def agent(episode):
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open({str(pid_file)!r}, "w") as file:
                file.write(str(sleeper.pid))
            os._exit(3)
    """, num_processes=1)
    [crashed] = run_on(loops(), host, episode(0))
    assert crashed.error.startswith("agent process died (exit code 3)")
    assert gone(int(pid_file.read_text()))


def test_a_process_that_forges_protocol_lines_is_replaced(make_host: MakeHost, loops: Callable) -> None:
    """What a child writes to its protocol pipe is untrusted: a line that is no JSON reply ends that process."""
    host = make_host("""
        import os, sys

        def agent(episode):
            if episode.index == 0:
                os.write(int(sys.argv[2]), b"not json\\n")  # the pipe to the parent
                return 5.0
            return 1.0
    """, num_processes=1)
    loop = loops()
    [forged] = run_on(loop, host, episode(0))
    assert forged.reward is None and "not JSON" in forged.error
    assert [r.reward for r in run_on(loop, host, episode(1))] == [1.0]
    assert host.stats()["restarts"] == 1


def test_a_memory_bomb_fails_only_its_episode(make_host: MakeHost, loops: Callable) -> None:
    host = make_host("""
        import resource

        def agent(episode):
            if episode.index == 1:
                return len(bytearray(8 << 30))
            return resource.getrlimit(resource.RLIMIT_AS)[0] / (1 << 20)
    """, num_processes=1, memory_limit_mb=512)
    loop = loops()
    limit, bomb = run_on(loop, host, episode(0), episode(1))
    assert limit.reward == 512.0
    assert bomb.reward is None and "MemoryError" in bomb.error
    assert [r.reward for r in run_on(loop, host, *(episode(i) for i in (2, 3, 4)))] == [512.0] * 3


@pytest.mark.parametrize("source, target, reason", [
    ("import no_such_module_xyz\ndef agent(episode): pass\n", "agent.py:agent", "No module named 'no_such_module_xyz'"),
    ("raise RuntimeError('boom')\n", "agent.py:agent", "RuntimeError: boom"),
    ("def other(episode): pass\n", "agent.py:agent", "has no attribute 'agent'"),
    ("agent = 3\n", "agent.py:agent", "agent is a int, not a function"),
    ("def agent(episode): pass\n", "missing.py:agent", "no such file"),
])
def test_a_function_that_cannot_load_is_refused_at_start(tmp_path: Path, source: str, target: str,
                                                         reason: str) -> None:
    (tmp_path / "agent.py").write_text(source)
    host = AgentHost(target, num_processes=2, base_dir=str(tmp_path))
    with pytest.raises(AgentHostError) as info:
        host.start()
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / target.partition(":")[0]) in message and reason in message
    assert processes_mentioning(str(tmp_path)) == []


def test_a_failed_start_leaves_no_process_that_did_load(tmp_path: Path) -> None:
    """Only the first of three processes loads the module: start() fails, and ends the one that loaded too."""
    (tmp_path / "agent.py").write_text(textwrap.dedent(f"""
        import os
        os.close(os.open({str(tmp_path / "first")!r}, os.O_CREAT | os.O_EXCL))  # FileExistsError for the others

        def agent(episode):
            return 1.0
    """))
    host = AgentHost("agent.py:agent", num_processes=3, base_dir=str(tmp_path))
    with pytest.raises(AgentHostError, match="FileExistsError"):
        host.start()
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize("target", ["agent.py", "agent.py:", ":agent", "agent.py:not-a-name"])
def test_a_malformed_target_is_refused(target: str) -> None:
    with pytest.raises(AgentHostError, match="must read 'package.module:function'"):
        AgentHost(target)


def test_a_module_target_loads_from_the_path(make_host: MakeHost, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_agents.py").write_text("def agent(episode):\n    return episode.max_tokens\n")
    monkeypatch.chdir(tmp_path)  # the children start in the trainer's cwd, which `python -m` puts on their path
    host = AgentHost("my_agents:agent", num_processes=1)
    try:
        host.start()
        assert asyncio.run(host.run(episode())).reward == 256.0
    finally:
        host.close()


def test_close_leaves_nothing_running(make_host: MakeHost, loops: Callable, tmp_path: Path) -> None:
    """Not the processes, nor what an agent function started and left running; an episode in flight is answered."""
    pid_file, running = tmp_path / "grandchild", tmp_path / "running"
    host = make_host(f"""
        import os, subprocess, sys, time

        def agent(episode):
            if episode.index == 0:
                while not os.path.exists({str(running)!r}):  # episode 1 is in flight on the other process
                    time.sleep(0.01)
                sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                with open({str(pid_file)!r}, "w") as file:
                    file.write(str(sleeper.pid))
                return os.getpid()
            open({str(running)!r}, "w").close()
            time.sleep(60)
    """, num_processes=2)
    loop = loops()
    in_flight = asyncio.run_coroutine_threadsafe(host.run(episode(1)), loop)
    [spawner] = run_on(loop, host, episode(0))
    children = {int(spawner.reward), int(pid_file.read_text())}
    assert not any(gone(pid) for pid in children)
    host.close()
    result = in_flight.result(timeout=10)
    assert result.error == "the agent host closed while the episode ran"
    assert all(gone(pid) for pid in children)
    assert processes_mentioning(str(tmp_path)) == []
    host.close()  # idempotent
    assert asyncio.run(host.run(episode(2))).error == "the agent host is closed"


@pytest.mark.parametrize("option", ["num_processes", "episode_timeout", "max_episodes_per_process",
                                    "memory_limit_mb"])
def test_options_must_be_positive(option: str) -> None:
    with pytest.raises(ValueError, match=f"AgentHost {option} must be positive, got 0"):
        AgentHost("agent.py:agent", **{option: 0})
