"""Runs many agent trajectories on one rollout engine: `AgentRunner`.

The trajectories are coroutines on an event loop that lives in a thread of its own for the runner's lifetime, so
tools (subprocesses, sockets, sleeps) make progress whenever they can, also between the worker's calls. The engine
is stepped only inside `drive` (on that loop, between the coroutines' turns) and never otherwise from the loop's
thread: a model turn's `generate` only queues its request, which `drive` submits before its next step. So the
worker's other calls (weight sync: abort, load, resume) may touch the engine whenever no `drive` runs, and a
trajectory paused mid turn by such a call resumes under the new weights with per-token policy versions.

A trajectory waiting on a tool holds no decode row (its cache slot is parked), and the others keep decoding: the
runner counts the decode steps it ran while some trajectory waited (`decode_steps_during_tools`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from shardrl.agents.agent_host import AgentHost
from shardrl.agents.endpoint import Endpoint, EndpointAgentLoop, EndpointSettings
from shardrl.agents.loop import (
    AGENT_LOOPS,
    AgentContext,
    AgentLoop,
    AgentLoopError,
    AgentSample,
    Episode,
    ToolBox,
    TurnLimits,
)
from shardrl.agents.parsers import get_parser
from shardrl.agents.function_tools import check_unique_names, load_function_tools
from shardrl.agents.registry import import_class, load_interactions, load_tools
from shardrl.agents.render import TurnRenderer
from shardrl.agents.trajectory import Trajectory
from shardrl.rollout.engine import Engine, common_prefix
from shardrl.rollout.request import RequestOutput, SamplingParams

IDLE_WAIT_S = 0.05  # a streaming drive with nothing to step waits this long for a tool before returning
# Turns queued while others decode that need a prefill step (more new tokens than the engine feeds through decode
# rows, `EngineConfig.max_fed_tokens`) enter the engine together, once 1/TURN_CHUNK of the running sequences are
# queued or the oldest has waited MAX_TURN_WAIT_STEPS decode steps: every prefill step stalls all running rows
# (and makes the next decode step launch from the host), so one prefill per arriving turn would cost each turn a
# whole step of the batch. Turns the engine feeds go in at once.
TURN_CHUNK = 4
MAX_TURN_WAIT_STEPS = 16


@dataclass
class RunnerStats:
    """What the runner did since the last `take_stats`: decode steps that ran while some trajectory waited on its
    tools (the waits it hid), and the time the engine stood idle because every trajectory waited (the waits it
    could not), as wall-clock (`time.time()`) spans for the timeline."""

    decode_steps_during_tools: int = 0
    tool_idle_seconds: float = 0.0
    tool_idle_spans: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class _Turn:
    """A model turn queued for the engine: `continues` names the trajectory's previous turn (its parked slot)."""

    prompt_ids: list[int]
    params: SamplingParams
    continues: str | None
    request_id: str
    future: asyncio.Future[RequestOutput]
    new_tokens: int  # since the previous turn's last sampled token (that one included)


class AgentRunner:
    def __init__(self, engine: Engine, context: AgentContext, loops: dict[str, AgentLoop], default_loop: str,
                 decode: Callable[[list[int]], str]) -> None:
        if default_loop not in loops:
            raise AgentLoopError(f"agent.default_agent_loop={default_loop!r}: no such agent loop; there are "
                                 f"{sorted(loops)}")
        self.engine, self.context, self.loops, self.default_loop = engine, context, loops, default_loop
        self.decode = decode
        self.stats = RunnerStats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-runner", daemon=True)
        self._thread.start()
        self._pending: list[_Turn] = []  # queued turns, submitted by the next drive step
        self._pending_steps = 0  # decode steps the oldest queued turn has waited
        self._waiting: dict[str, _Turn] = {}  # request id -> its turn, in the engine
        self._active: dict[Hashable, asyncio.Task] = {}
        self._done: dict[Hashable, Trajectory] = {}
        self._release: list[str] = []  # parked slots of ended trajectories, freed by the next drive step
        self._wake = asyncio.Event()
        self._in_tools = 0  # trajectories now between a model turn and the next (their tools' time)
        self._ids = itertools.count()

    # ---- the worker's side (any thread) ------------------------------------------------------------------------

    def start(self, samples: list[tuple[Hashable, AgentSample, str | None]]) -> None:
        """Start one trajectory per (key, sample, agent name or None for the default loop)."""
        for key, _, name in samples:
            loop_name = name or self.default_loop
            if loop_name not in self.loops:
                raise AgentLoopError(f"agent_name={loop_name!r} (sample {key!r}): no such agent loop; there are "
                                     f"{sorted(self.loops)}")
        self._call(self._start(samples)).result()

    def drive(self, max_steps: int | None, keys: set[Hashable] | None = None) -> dict[Hashable, Trajectory]:
        """Step the engine until the trajectories `keys` (None: every started one) are done, or for at most
        `max_steps` engine steps; returns the trajectories finished meanwhile (among `keys`)."""
        return self._call(self._drive(max_steps, keys)).result()

    def take_stats(self) -> RunnerStats:
        """The stats since the last call (read between drives: only a drive writes them)."""
        stats, self.stats = self.stats, RunnerStats()
        return stats

    def pending(self) -> int:
        """Trajectories started and not yet returned."""
        return len(self._active) + len(self._done)

    def close(self) -> None:
        """Close the loops (their agent processes, the endpoint), then stop the runner's thread."""
        self._call(self._close_loops()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _close_loops(self) -> None:
        for loop in self.loops.values():
            await loop.aclose()

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    # ---- the loop's side ---------------------------------------------------------------------------------------

    async def _start(self, samples: list[tuple[Hashable, AgentSample, str | None]]) -> None:
        for key, sample, name in samples:
            self._active[key] = asyncio.ensure_future(self._trajectory(key, sample, name or self.default_loop))

    async def _trajectory(self, key: Hashable, sample: AgentSample, loop_name: str) -> None:
        session = f"traj{next(self._ids)}"
        turns = itertools.count()
        previous: str | None = None  # the request id of the trajectory's last turn: its parked slot
        cached: list[int] = []  # the trajectory's tokens when its last turn ended

        async def generate(prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
            nonlocal previous, cached
            request_id = f"{session}/{next(turns)}"
            turn = _Turn(prompt_ids, params, previous, request_id, asyncio.get_running_loop().create_future(),
                         len(prompt_ids) - common_prefix(cached, prompt_ids) + 1)
            if previous is not None:  # back from its environment turn
                self._in_tools -= 1
            previous = request_id
            self._pending.append(turn)
            self._wake.set()
            out = await turn.future
            cached = out.prompt_ids + out.token_ids
            self._in_tools += 1
            return out

        episode = Episode(sample, generate, self.decode, self.context.limits.response_length)
        try:
            await self.loops[loop_name].run(episode)
        except Exception as exc:  # the user's loop, tool or interaction failed: contained, counted, kept
            episode.trajectory.error = f"{type(exc).__name__}: {exc}"
            episode.trajectory.finish_reason = "error"
        finally:
            if previous is not None:
                self._in_tools -= 1
                self._release.append(previous)
            self._active.pop(key, None)
            self._done[key] = episode.trajectory
            self._wake.set()

    async def _drive(self, max_steps: int | None, keys: set[Hashable] | None) -> dict[Hashable, Trajectory]:
        engine, steps = self.engine, 0
        while True:
            self._submit_pending()
            wanted = self._active.keys() if keys is None else keys & self._active.keys()
            if not wanted or (max_steps is not None and steps >= max_steps):
                break
            if engine.has_unfinished():
                decode = engine.stats.decode_steps
                for out in engine.step():
                    turn = self._waiting.pop(out.request_id)
                    turn.future.set_result(out)
                steps += 1
                if self._in_tools > 0 and engine.stats.decode_steps > decode:
                    self.stats.decode_steps_during_tools += 1
                await asyncio.sleep(0)  # the trajectories whose turn finished, and the tools, run now
                continue
            self._wake.clear()
            start = time.time()
            try:
                async with asyncio.timeout(IDLE_WAIT_S if max_steps is not None else None):
                    await self._wake.wait()
            except TimeoutError:
                break
            finally:
                end = time.time()
                self.stats.tool_idle_seconds += end - start
                self.stats.tool_idle_spans.append((start, end))
        chosen = list(self._done) if keys is None else [k for k in self._done if k in keys]
        return {k: self._done.pop(k) for k in chosen}

    def _submit_pending(self) -> None:
        """Hand the engine what the trajectories asked for since the last step (only a drive touches it), in chunks
        while others decode (`TURN_CHUNK`)."""
        if self._release:
            self.engine.release_cache(self._release)
            self._release = []
        fed = self.engine.config.max_fed_tokens
        now, later = [], []
        for turn in self._pending:
            (now if turn.continues is not None and turn.new_tokens <= fed else later).append(turn)
        running = len(self.engine.scheduler.running)
        if later and running and len(later) < -(-running // TURN_CHUNK) and self._pending_steps < MAX_TURN_WAIT_STEPS:
            self._pending_steps += 1
        elif later:
            now, later = now + later, []
            self._pending_steps = 0
        for turn in now:
            try:
                self.engine.submit(turn.prompt_ids, turn.params, turn.request_id, keep_cache=True,
                                   continues=turn.continues)
            except ValueError as err:  # EngineError or the scheduler's: e.g. the trajectory outgrew max_model_len
                turn.future.set_exception(AgentLoopError(f"turn {turn.request_id}: {err}"))
                continue
            self._waiting[turn.request_id] = turn
        self._pending = later


@dataclass(frozen=True)
class AgentSettings:
    """Everything a rollout worker needs to run agent trajectories (what the planner compiles from verl's
    `rollout.multi_turn.*` and `rollout.agent.*`); plain data, so it travels to the workers."""

    limits: TurnLimits
    tokenizer_path: str | None = None  # filled in at launch (the built-in task's tokenizer is made there)
    format: str = "hermes"  # the tool-call syntax (`parsers.PARSERS`)
    tool_config_path: str | None = None
    function_tool_path: str | None = None  # verl 0.9's @function_tool file: its tools run in processes of their own
    interaction_config_path: str | None = None
    agent_loop_config_path: str | None = None
    default_agent_loop: str = "single_turn_agent"
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # data.apply_chat_template_kwargs
    endpoint: EndpointSettings = EndpointSettings()  # for agent functions (`agents.endpoint`)


def build_runner(engine: Engine, settings: AgentSettings) -> AgentRunner:
    """The runner of one worker: tools, interactions and loops built from their config files, the chat format
    from the tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
    tools = load_tools(settings.tool_config_path) if settings.tool_config_path else []
    if settings.function_tool_path:
        tools += load_function_tools(settings.function_tool_path, settings.limits.tool_timeout,
                                     settings.limits.max_concurrent_tool_calls)
        check_unique_names([tool.name for tool in tools], settings.function_tool_path)
    toolbox = ToolBox(tools, settings.limits)
    interactions = load_interactions(settings.interaction_config_path) if settings.interaction_config_path else {}
    renderer = TurnRenderer(tokenizer, toolbox.schemas, dict(settings.template_kwargs))
    context = AgentContext(renderer, get_parser(settings.format), toolbox, interactions, settings.limits)
    loops = {name: cls(context) for name, cls in AGENT_LOOPS.items()}
    if settings.agent_loop_config_path:
        endpoint = Endpoint(settings.endpoint, tokenizer, context, dict(settings.template_kwargs))
        loops |= load_agent_loops(settings.agent_loop_config_path, context, endpoint)
    return AgentRunner(engine, context, loops, settings.default_agent_loop,
                       lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def agent_host(function: str, settings: EndpointSettings, base_dir: Path, num_processes: int | None = None) -> AgentHost:
    """The processes an agent function runs in (`agent.num_workers` of them, unless `num_processes`)."""
    return AgentHost(function, num_processes=num_processes or settings.num_workers,
                     episode_timeout=settings.episode_timeout,
                     max_episodes_per_process=settings.max_episodes_per_process,
                     memory_limit_mb=settings.memory_limit_mb, base_dir=str(base_dir))


def load_agent_loops(path: str, context: AgentContext, endpoint: Endpoint) -> dict[str, AgentLoop]:
    """verl's `agent.agent_loop_config_path`: a yaml list of `{name, _target_: pkg.module.Class or
    file.py:Class, <settings>}`, each class an `AgentLoop` subclass built with the settings as keyword arguments;
    or (shardrl) `{name, function: file.py:function or pkg.module:function}`, an agent function that talks to the
    policy through the OpenAI-compatible `endpoint`, run in agent processes of its own (never imported here)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise AgentLoopError(f"agent.agent_loop_config_path={path}: file not found")
    entries = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    if not isinstance(entries, list):
        raise AgentLoopError(f"{file}: must be a list of {{name, _target_, ...}} entries (verl's format)")
    loops: dict[str, AgentLoop] = {}
    for index, entry in enumerate(entries):
        where = f"{file}: [{index}]"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str) and "function" in entry:
            if set(entry) != {"name", "function"}:
                raise AgentLoopError(f"{where}: an agent-function entry takes only `name` and `function`; got "
                                     f"{sorted(entry)}")
            host = agent_host(str(entry["function"]), endpoint.settings, file.parent)
            host.start()
            loops[entry["name"]] = EndpointAgentLoop(context, endpoint, host)
            loops[entry["name"]].name = entry["name"]
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "_target_" not in entry:
            raise AgentLoopError(f"{where}: needs `name` and `_target_` (pkg.module.Class or file.py:Class), or "
                                 f"`name` and `function` (an agent function)")
        settings = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        cls = import_class(entry["_target_"], file.parent, where)
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise AgentLoopError(f"{where}: {entry['_target_']} is not a shardrl.agents.loop.AgentLoop subclass")
        try:
            loops[entry["name"]] = cls(context, **settings)
        except Exception as exc:
            raise AgentLoopError(f"{where}: building {entry['_target_']} failed: {type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())}") from exc
        loops[entry["name"]].name = entry["name"]
    return loops
