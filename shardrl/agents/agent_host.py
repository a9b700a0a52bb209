"""Run user agent functions in a pool of child processes, so that nothing they do can reach the trainer's process.

An agent function is the user's own program for one episode: it talks to the policy through the OpenAI-compatible
endpoint that shardrl serves for that episode (`AgentEpisode.base_url`) and returns a reward, or None to leave the
scoring to the run's reward function. It is arbitrary code, so it runs in a `FunctionPool` (shardrl.usercode.pool:
crash containment, timeouts, restarts, memory limits, process-group kill on close) of `num_processes` children (what
verl's `actor_rollout_ref.rollout.agent.num_workers` counts: agent worker processes). This module adds what is
particular to agents: the episode crosses as JSON and becomes an `AgentEpisode` again in the child, and what the
function returns must be a reward.

Whatever the function does, `run` returns an `EpisodeResult` at most `episode_timeout` after the episode reached a
process. A sync function's thread cannot be stopped: on a timeout it runs on until its process is replaced, so the
endpoint behind the episode's base_url must refuse its further requests (the caller arranges that).
"""

from __future__ import annotations

import inspect
import reprlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

from shardrl.usercode.pool import FunctionPool, check_positive
from shardrl.usercode.wire import LoadError, is_finite_number, one_line

AgentHostError = LoadError  # the agent function cannot be loaded (bad target, import error, not callable)


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
        check_positive("AgentHost", num_processes=num_processes, episode_timeout=episode_timeout,
                       max_episodes_per_process=max_episodes_per_process, memory_limit_mb=memory_limit_mb)
        self._pool = FunctionPool(target, num_processes=num_processes, timeout=episode_timeout,
                                  max_concurrent_per_process=max_episodes_per_process,
                                  memory_limit_mb=memory_limit_mb, base_dir=base_dir, label="agent",
                                  wrapper=f"{__name__}:takes_episode_fields")
        self._name = self._pool.target.rpartition(":")[2]
        self._lock = threading.Lock()
        self._no_rewards = 0  # episodes whose function returned something that is no reward

    def start(self) -> None:
        """Start the processes and wait until each has loaded the function; AgentHostError (none left) if one fails."""
        self._pool.start()

    async def run(self, episode: AgentEpisode) -> EpisodeResult:
        """Run one episode on the least-loaded process; whatever the agent function does comes back as the result.
        A TypeError (the caller's bug) for an episode whose data JSON cannot carry."""
        result = await self._pool.call(vars(episode))
        if result.error is not None:
            return EpisodeResult(error=result.error, timed_out=result.timed_out, seconds=result.seconds)
        reward = result.value
        if reward is not None and not is_finite_number(reward):
            with self._lock:
                self._no_rewards += 1
            return EpisodeResult(error=one_line(f"agent function {self._name} returned {type(reward).__name__} "
                                                f"{reprlib.repr(reward)}; it must return a finite float or int, "
                                                f"or None"), seconds=result.seconds)
        return EpisodeResult(None if reward is None else float(reward), seconds=result.seconds)

    def stats(self) -> dict[str, int]:
        """Counts since start: episodes returned, failed (timeouts and crashes included), timed_out, crashed (lost
        with a dead process), restarts (processes started in place of dead or stuck ones)."""
        counts = self._pool.stats()
        with self._lock:
            failed = counts["failed"] + self._no_rewards
        return {"episodes": counts["calls"], "failed": failed, "timed_out": counts["timed_out"],
                "crashed": counts["crashed"], "restarts": counts["restarts"]}

    def close(self) -> None:
        """End every process and what it started in its group: SIGTERM, SIGKILL after a short grace. Idempotent."""
        self._pool.close()


def takes_episode_fields(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run in the child on the user's function: it is called with the fields that crossed as JSON, and receives
    them as this module's `AgentEpisode` again (so `isinstance(episode, AgentEpisode)` holds in user code)."""
    if inspect.iscoroutinefunction(function):
        async def call_async(fields: dict[str, Any]) -> Any:
            return await function(AgentEpisode(**fields))
        return call_async

    def call(fields: dict[str, Any]) -> Any:
        return function(AgentEpisode(**fields))
    return call
