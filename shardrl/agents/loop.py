"""Agent loops: how one trajectory alternates model turns and environment turns.

A loop drives an `Episode`: `await episode.generate()` samples the next model turn (continuing the trajectory's
tokens in the engine, its cached prefix kept), `episode.append(ids, source)` adds environment tokens. Loops never
build the token sequence themselves, so they cannot re-tokenize what the model sampled. Built in, by verl's
names: `single_turn_agent` (one model turn) and `tool_agent` (tool calls parsed from each turn, run, their results
appended in the model's chat format, until the model stops calling, a turn limit, or the response budget; with an
interaction configured, a simulated user answers turns without calls). Users add loops with `register`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from shardrl.agents.interactions import BaseInteraction
from shardrl.agents.parsers import FunctionCall, ParsedTurn
from shardrl.agents.render import TurnRenderer
from shardrl.agents.tools import BaseTool, ToolResponse
from shardrl.agents.trajectory import Source, Trajectory
from shardrl.rollout.request import RequestOutput, SamplingParams

TruncateSide = Literal["left", "middle", "right"]


class AgentLoopError(ValueError):
    """A sample names an agent loop, tool or interaction that does not exist; the message says which."""


@dataclass(frozen=True)
class TurnLimits:
    """verl's `rollout.multi_turn` limits, plus the tool-call timeout and concurrency shardrl adds."""

    response_length: int  # tokens of the whole response, model and environment tokens together
    prompt_length: int | None = None  # the trainer's prompt width: an external agent's longer prompt spills over
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256  # characters
    tool_response_truncate_side: TruncateSide = "middle"
    tool_timeout: float = 30.0  # seconds per call (create + execute)
    max_concurrent_tool_calls: int = 64  # per rollout worker, over all trajectories


@dataclass
class AgentSample:
    """What a loop knows of its sample: the dataset's row."""

    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    extra_info: dict[str, Any]
    params: SamplingParams  # the sample's sampling settings; `max_tokens` caps each turn, the budget left too

    @property
    def tools_kwargs(self) -> dict[str, Any]:
        return self.extra_info.get("tools_kwargs") or {}

    @property
    def interaction_kwargs(self) -> dict[str, Any]:
        return self.extra_info.get("interaction_kwargs") or {}


@dataclass
class ModelTurn:
    ids: list[int]
    text: str  # decoded only to parse calls; the trajectory keeps `ids`
    finish_reason: str


@dataclass
class AgentData:
    """verl's per-trajectory state object, handed to tools as `execute(..., agent_data=...)`."""

    messages: list[dict[str, Any]]
    request_id: str
    tools_kwargs: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)


Generate = Callable[[list[int], SamplingParams], Awaitable[RequestOutput]]


class Episode:
    """One trajectory in the making; `generate` is the runner's (the engine behind it)."""

    def __init__(self, sample: AgentSample, generate: Generate, decode: Callable[[list[int]], str],
                 response_length: int) -> None:
        self.sample, self._generate, self._decode = sample, generate, decode
        self.response_length = response_length
        self.trajectory = Trajectory(list(sample.prompt_ids))

    @property
    def remaining(self) -> int:
        """Response tokens still allowed."""
        return self.response_length - len(self.trajectory.response_ids)

    async def generate(self, params: SamplingParams | None = None) -> ModelTurn:
        """The next model turn, sampled with `params` (default: the sample's): at most their `max_tokens` (the
        sample's is the response length, unless set lower) and the `remaining` budget."""
        traj, params = self.trajectory, params or self.sample.params
        if self.remaining <= 0:
            raise AgentLoopError(f"generate: the response budget ({self.response_length} tokens) is spent; end the "
                                 f"trajectory when episode.remaining is 0")
        params = _with_max_tokens(params, min(params.max_tokens, self.remaining))
        out = await self._generate(traj.prompt_ids + traj.response_ids, params)
        traj.add_model(out.token_ids, out.logprobs, out.policy_versions, out.routed_experts)
        traj.assistant_turns += 1
        traj.finish_reason = out.finish_reason or "stop"
        return ModelTurn(out.token_ids, self._decode(out.token_ids), traj.finish_reason)

    def append(self, ids: list[int], source: Source) -> bool:
        """Add environment tokens; False (and nothing added) when they do not fit the budget with room for a
        model token after them: the trajectory ends there, as in verl."""
        if len(ids) >= self.remaining:
            self.trajectory.finish_reason = "length"
            return False
        self.trajectory.add_environment(ids, source)
        self.trajectory.user_turns += 1
        return True


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=max_tokens, n=1)


@dataclass
class ToolResult:
    text: str
    reward: float | None = None
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


class ToolBox:
    """The configured tools, called under a per-call timeout and a concurrency limit shared by every trajectory
    of the worker. A call that fails in any way answers the model with an error message instead of ending the
    run: tool code is the user's, and its failures are part of the environment.

    The tools run on an event loop of their own, in a thread of their own, not on the runner's: a tool that blocks
    its thread (a synchronous sleep or request, a long computation) delays the other tools' calls but never the
    engine's decoding, and the trajectory waiting on it still gets its timeout on time. (What the blocked call
    does after its timeout is the tool's business; its release runs when it returns.)"""

    def __init__(self, tools: list[BaseTool], limits: TurnLimits) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.tool_schema.model_dump() for tool in tools]
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.max_concurrent_tool_calls)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="agent-tools", daemon=True).start()

    async def call(self, call: FunctionCall, agent_data: AgentData) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}", error=True)
        start = time.perf_counter()
        async with self._slots:
            running = asyncio.run_coroutine_threadsafe(self._run(tool, call, agent_data), self._loop)
            try:
                async with asyncio.timeout(self.limits.tool_timeout):
                    response, reward = await asyncio.wrap_future(running)
            except TimeoutError:
                return ToolResult(f"Error: tool {call.name!r} timed out after {self.limits.tool_timeout:g} s",
                                  error=True, timed_out=True, seconds=time.perf_counter() - start)
            except Exception as exc:  # the user's tool failed: the model reads why
                return ToolResult(f"Error when executing tool {call.name!r}: {type(exc).__name__}: {exc}",
                                  error=True, seconds=time.perf_counter() - start)
        text = response.text if isinstance(response, ToolResponse) else str(response)
        if isinstance(response, ToolResponse) and (response.image or response.video):
            return ToolResult(f"Error: tool {call.name!r} returned images or video; this agent loop is text-only",
                              error=True, seconds=time.perf_counter() - start)
        return ToolResult(self.truncate(text or ""), None if reward is None else float(reward),
                          seconds=time.perf_counter() - start)

    async def _run(self, tool: BaseTool, call: FunctionCall,
                   agent_data: AgentData) -> tuple[ToolResponse | str, float | None]:
        """create -> execute -> release, on the tools' loop (cancelled there when the call times out)."""
        kwargs = agent_data.tools_kwargs.get(call.name, {})
        instance_id = None
        try:
            instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
            response, reward, _ = await tool.execute(instance_id, dict(call.arguments), agent_data=agent_data)
            return response, reward
        finally:
            if instance_id is not None:
                await _release(tool, instance_id, self.limits.tool_timeout)

    def truncate(self, text: str) -> str:
        """verl's truncation of a long tool response: `left` keeps the head, `right` the tail, `middle` both."""
        limit, side = self.limits.max_tool_response_length, self.limits.tool_response_truncate_side
        if len(text) <= limit:
            return text
        if side == "left":
            return text[:limit] + "...(truncated)"
        if side == "right":
            return "(truncated)..." + text[-limit:]
        return text[:limit // 2] + "...(truncated)..." + text[-(limit // 2):]


async def _release(tool: BaseTool, instance_id: str, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await tool.release(instance_id)
    except Exception:  # a failed release must not lose the trajectory; the instance is the tool's to forget
        pass


@dataclass
class AgentContext:
    """What every loop of a worker shares: the chat format, the tools, the interactions and the limits."""

    renderer: TurnRenderer
    parse: Callable[[str], ParsedTurn]
    toolbox: ToolBox
    interactions: dict[str, BaseInteraction]
    limits: TurnLimits


class AgentLoop:
    """One way to run a trajectory. Subclasses implement `run`; `register(name)` makes them selectable by a
    sample's `agent_name`. Constructed once per worker with the shared context and its config entry's kwargs."""

    name: ClassVar[str] = ""

    def __init__(self, context: AgentContext, **kwargs: Any) -> None:
        if kwargs:
            raise AgentLoopError(f"agent loop {self.name!r} takes no settings; got {sorted(kwargs)}")
        self.context = context

    async def run(self, episode: Episode) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Free what the loop holds (processes, servers) when its runner closes; on the runner's event loop."""


AGENT_LOOPS: dict[str, type[AgentLoop]] = {}


def register(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator: make an `AgentLoop` subclass the loop a sample's `agent_name` selects by `name`."""

    def add(cls: type[AgentLoop]) -> type[AgentLoop]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise AgentLoopError(f"register({name!r}): {cls!r} is not an AgentLoop subclass")
        cls.name = name
        AGENT_LOOPS[name] = cls
        return cls

    return add


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    async def run(self, episode: Episode) -> None:
        await episode.generate()


@register("tool_agent")
class ToolAgentLoop(AgentLoop):
    """verl's tool agent loop, token-exact: generate; parse calls; run up to `max_parallel_calls` concurrently;
    answer every call (results, or error messages for malformed or failed calls) in one environment turn; repeat.
    Without calls the trajectory ends, unless an interaction (the sample's `interaction_kwargs.name`) answers as
    the user."""

    async def run(self, episode: Episode) -> None:
        ctx, traj, sample = self.context, episode.trajectory, episode.sample
        limits = ctx.limits
        messages = list(sample.messages)
        agent_data = AgentData(messages, str(id(episode)), sample.tools_kwargs)
        interaction, interaction_id = await self._start_interaction(sample)
        try:
            while True:
                turn = await episode.generate()
                if episode.remaining <= 0:
                    return
                if _reached(limits.max_assistant_turns, traj.assistant_turns) or _reached(
                        limits.max_user_turns, traj.user_turns):
                    traj.finish_reason = "max_turns"
                    return
                parsed = ctx.parse(turn.text)
                messages.append({"role": "assistant", "content": turn.text})
                if parsed.calls or parsed.errors:
                    replies = await self._run_calls(parsed, agent_data, traj)
                    messages.extend(replies)
                    if not episode.append(ctx.renderer.env_ids(replies, turn.ids), Source.TOOL):
                        return
                elif interaction is not None:
                    done, text, score, _ = await interaction.generate_response(
                        interaction_id, messages, **sample.interaction_kwargs)
                    if score is not None:
                        traj.turn_scores.append(float(score))
                    if done:
                        return
                    reply = [{"role": "user", "content": text}]
                    messages.extend(reply)
                    if not episode.append(ctx.renderer.env_ids(reply, turn.ids), Source.USER):
                        return
                else:
                    return
        finally:
            if interaction is not None:
                await interaction.finalize_interaction(interaction_id)

    async def _start_interaction(self, sample: AgentSample) -> tuple[BaseInteraction | None, str | None]:
        if not self.context.interactions:
            return None, None
        kwargs = sample.interaction_kwargs
        name = kwargs.get("name")
        if name not in self.context.interactions:
            raise AgentLoopError(f"extra_info.interaction_kwargs.name={name!r}: no such interaction in "
                                 f"multi_turn.interaction_config_path; there are {sorted(self.context.interactions)}")
        interaction = self.context.interactions[name]
        return interaction, await interaction.start_interaction(None, **kwargs)

    async def _run_calls(self, parsed: ParsedTurn, agent_data: AgentData,
                         traj: Trajectory) -> list[dict[str, Any]]:
        """One tool message per call (errors for malformed ones first, in the parser's order), the calls beyond
        `max_parallel_calls` answered as refused."""
        limits, toolbox = self.context.limits, self.context.toolbox
        calls = parsed.calls[:limits.max_parallel_calls]
        skipped = len(parsed.calls) - len(calls)
        start = time.perf_counter()
        results = await asyncio.gather(*(toolbox.call(call, agent_data) for call in calls))
        traj.tool_wait_seconds += time.perf_counter() - start
        traj.tool_calls += len(calls)
        traj.tool_errors += len(parsed.errors) + sum(r.error and not r.timed_out for r in results)
        traj.tool_timeouts += sum(r.timed_out for r in results)
        traj.tool_seconds += sum(r.seconds for r in results)
        traj.tool_rewards += [r.reward for r in results if r.reward is not None]
        texts = list(parsed.errors) + [r.text for r in results]
        if skipped:
            texts.append(f"Error: {skipped} more tool calls than max_parallel_calls={limits.max_parallel_calls} "
                         f"in one turn; they were not run")
            traj.tool_errors += 1
        return [{"role": "tool", "content": text} for text in texts]


def _reached(limit: int | None, count: int) -> bool:
    return limit is not None and count >= limit
