"""AgentHost against real child processes: what it adds to the FunctionPool it runs on (the episode crossing as an
AgentEpisode, rewards checked, its counts and errors), each tried by an agent function that breaks it. The pool's
own guarantees (concurrency, crashes, restarts, limits, close) are tried in test_usercode_pool.py.

The episodes are awaited on event loops in background threads, as the rollout's runner awaits them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from process_checks import gather_on, processes_mentioning, started_from_source

from shardrl.agents.agent_host import AgentEpisode, AgentHost, AgentHostError, EpisodeResult

pytestmark = pytest.mark.timeout(60)

MakeHost = Callable[..., AgentHost]


def episode(index: int = 0, **extra_info: object) -> AgentEpisode:
    return AgentEpisode(base_url=f"http://127.0.0.1:9/{index}/v1", api_key="key", model="policy",
                        messages=[{"role": "user", "content": "What is 2 + 2?"}],
                        tools=[{"type": "function", "function": {"name": "calc", "parameters": {}}}],
                        extra_info=dict(extra_info), max_tokens=256, index=index)


@pytest.fixture
def make_host(tmp_path: Path) -> Iterator[MakeHost]:
    """Write `source` as tmp_path/agent.py and start a host on its `function`; every host is closed afterwards."""
    with started_from_source(tmp_path / "agent.py", "agent", AgentHost) as make:
        yield make


def run_on(loop: asyncio.AbstractEventLoop, host: AgentHost, *episodes: AgentEpisode) -> list[EpisodeResult]:
    """Run the episodes at once on `loop` (in its thread); their results in order."""
    return gather_on(loop, *(host.run(e) for e in episodes))


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


@pytest.mark.parametrize("target", ["agent.py", "agent.py:", ":agent", "agent.py:not-a-name"])
def test_a_malformed_target_is_refused(target: str) -> None:
    with pytest.raises(AgentHostError, match="must read 'package.module:function'"):
        AgentHost(target)


@pytest.mark.parametrize("option", ["num_processes", "episode_timeout", "max_episodes_per_process",
                                    "memory_limit_mb"])
def test_options_must_be_positive(option: str) -> None:
    with pytest.raises(ValueError, match=f"AgentHost {option} must be positive, got 0"):
        AgentHost("agent.py:agent", **{option: 0})
