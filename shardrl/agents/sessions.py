"""One external agent's episode as the OpenAI-compatible endpoint records it: `Session`.

An agent program re-sends its whole conversation with every request. The session matches it against what it has
recorded, unit by unit: the first prompt (with its tools), each model turn as the endpoint returned it, each batch of
tool or user messages the client added after one. The matched history keeps its recorded tokens, the model's turns
their sampled ids, and only the messages after it are tokenised, on their own (`TurnRenderer`): nothing the model
sampled is decoded and encoded again, and the trajectory is exactly the tokens the engine ran.

When the client changed its history (edited an assistant message or a tool result, inserted an assistant message it
wrote itself), the session keeps the recorded tokens up to the last model turn before the change and appends the
template's rendering of everything after it as REWRITTEN tokens (masked: never trained on), and counts the request
as divergent. A change before the first model turn restarts the trajectory from the new prompt (also divergent). A
request that re-sends the conversation up to a model turn's start asks for that turn again (a retry): the old turn is
dropped. `/v1/completions` sessions match the same way on the prompt's text (or its token ids).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from shardrl.agents.loop import AgentLoopError, Episode
from shardrl.agents.parsers import FunctionCall, ParsedTurn
from shardrl.agents.render import TurnRenderer
from shardrl.agents.trajectory import Source
from shardrl.rollout.request import SamplingParams


class RequestError(ValueError):
    """A request the session cannot serve: the one-line message, the HTTP status and OpenAI's error `code`."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


MessageKey = tuple[str, str, tuple[tuple[str, str], ...]]


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant message with only tool calls), or OpenAI's list of
    text parts. Other parts (images, audio) are refused: the endpoint serves a text-only policy."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content: a part of type {kind!r}; only text parts are served",
                                   param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts, not {type(content).__name__}",
                       param=where)


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments as a dict: OpenAI sends them as a JSON string, some clients as an object."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object (as a string)", param=where)
    return value


def _calls_of(message: dict[str, Any], where: str) -> list[FunctionCall]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}] needs function.name", param=where)
        out.append(FunctionCall(function["name"], _arguments(function.get("arguments", "{}"),
                                                             f"{where}.tool_calls[{j}]")))
    return out


def _calls_key(calls: Sequence[FunctionCall]) -> tuple[tuple[str, str], ...]:
    """Calls compared by name and decoded arguments: clients re-serialise the JSON we sent them."""
    return tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls)


@dataclass(frozen=True)
class ChatMessage:
    """A request's message, checked once: its key (what matching compares: the role, the text without surrounding
    whitespace, the calls) and the message as the chat template takes it."""

    key: MessageKey
    rendered: dict[str, Any]

    @classmethod
    def parse(cls, message: Any, index: int) -> ChatMessage:
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role and content", param=where)
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"{where}.role={role!r}: use system, user, assistant or tool", param=where)
        role = "system" if role == "developer" else role
        text = message_text(message.get("content"), where)
        calls = _calls_of(message, where) if role == "assistant" else []
        rendered: dict[str, Any] = {"role": role, "content": text}
        if calls:
            rendered["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                      for c in calls]
        return cls((role, text.strip(), _calls_key(calls)), rendered)


@dataclass(frozen=True)
class Reply:
    """One served model turn."""

    token_ids: list[int]
    logprobs: list[float]
    text: str  # the turn decoded (special tokens skipped), cut before a stop string
    content: str  # the text outside tool calls (all of it when calls were not parsed or were malformed)
    calls: list[FunctionCall]
    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int


@dataclass
class _Unit:
    """A recorded piece of the conversation: what the client must re-send for it to match (chat: the message keys,
    the first unit's led by the tools' key; completions: its text or token ids) and the trajectory's response
    length after it."""

    key: tuple[Any, ...] | str
    end: int
    model: bool


@dataclass
class _Plan:
    """How a request continues the trajectory: keep `keep` units (a restart keeps none and sets `prompt`), append
    `env` (a new unit keyed `env_key`, by `source`), then sample the model's turn."""

    keep: int
    env: list[int] = field(default_factory=list)
    env_key: tuple[Any, ...] | str = ()
    source: Source = Source.USER
    divergent: bool = False
    prompt: list[int] | None = None
    prompt_key: tuple[Any, ...] | str = ()


class Session:
    """The record of one episode's requests, on one `Episode` (the trajectory and the engine behind it). Requests
    are served one at a time (`lock`); once `closed`, none more."""

    def __init__(self, session_id: str, episode: Episode, tokenizer: PreTrainedTokenizerBase,
                 renderer_for: Callable[[list[dict[str, Any]]], TurnRenderer], parse: Callable[[str], ParsedTurn],
                 prompt_length: int | None) -> None:
        self.id, self.episode, self.tokenizer = session_id, episode, tokenizer
        self._renderer_for, self._parse, self._prompt_length = renderer_for, parse, prompt_length
        self.lock = asyncio.Lock()
        self.closed = False
        self._units: list[_Unit] = []
        self._kind: str | None = None

    # ---- chat ----------------------------------------------------------------------------------------------------

    async def chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]], params: SamplingParams,
                   stop: Sequence[str] = (), parse_calls: bool = True) -> Reply:
        """Serve one chat completion: match `messages` against the record, extend the trajectory, sample."""
        self._check_kind("chat")
        renderer = self._renderer_for(tools)
        keys = tuple(m.key for m in messages)
        prompt_key = (json.dumps(tools, sort_keys=True), *keys)
        plan = self._plan_chat(keys, [m.rendered for m in messages], renderer, prompt_key)
        return await self._serve(plan, params, stop, parse_calls)

    def _plan_chat(self, keys: tuple[MessageKey, ...], rendered: list[dict[str, Any]], renderer: TurnRenderer,
                   prompt_key: tuple[Any, ...]) -> _Plan:
        units = self._units
        if not units:
            return _Plan(0, prompt=renderer.prompt_ids(rendered), prompt_key=prompt_key)
        first = units[0].key
        matched, pos = 0, 0
        if prompt_key[:len(first)] == first:
            matched, pos = 1, len(first) - 1
            while matched < len(units) and keys[pos:pos + len(units[matched].key)] == units[matched].key:
                pos += len(units[matched].key)
                matched += 1
        rest = rendered[pos:]
        if matched == len(units) and units[-1].model:
            if not rest:
                raise RequestError("messages end with the assistant's reply the endpoint sent; add the tool results "
                                   "or the user's turn after it", param="messages")
            last = self._model_ids(len(units) - 1)
            if all(m["role"] in ("tool", "user") for m in rest):
                source = Source.TOOL if all(m["role"] == "tool" for m in rest) else Source.USER
                return _Plan(matched, renderer.env_ids(rest, last), keys[pos:], source)
        elif matched < len(units) and units[matched].model and not rest:
            return _Plan(matched)  # a retry of the turn that follows
        elif matched == len(units) and not rest:
            return _Plan(matched)  # the turn after the history failed before; sample it now
        model_units = [i for i in range(matched) if units[i].model]
        if not model_units:
            return _Plan(0, divergent=True, prompt=renderer.prompt_ids(rendered), prompt_key=prompt_key)
        keep = model_units[-1] + 1
        start = len(first) - 1 + sum(len(u.key) for u in units[1:keep])
        return _Plan(keep, renderer.rewritten_ids(rendered[start:], self._model_ids(keep - 1)), keys[start:],
                     Source.REWRITTEN, divergent=True)

    # ---- completions ---------------------------------------------------------------------------------------------

    async def complete(self, prompt: str | list[int], params: SamplingParams, stop: Sequence[str] = ()) -> Reply:
        """Serve one text completion: `prompt` (text, or token ids) matched against the record as in `chat`."""
        self._check_kind("completion")
        return await self._serve(self._plan_completion(prompt), params, stop, parse_calls=False)

    def _plan_completion(self, prompt: str | list[int]) -> _Plan:
        key: tuple[int, ...] | str = prompt if isinstance(prompt, str) else tuple(prompt)
        if not self._units:
            return _Plan(0, prompt=self._encode(key, first=True), prompt_key=key)
        matched, pos = 0, 0
        for unit in self._units:
            if type(unit.key) is not type(key) or key[pos:pos + len(unit.key)] != unit.key:
                break
            pos += len(unit.key)
            matched += 1
        rest = key[pos:]
        if matched < len(self._units) and self._units[matched].model and not rest:
            return _Plan(matched)
        if matched == 0:
            return _Plan(0, divergent=True, prompt=self._encode(key, first=True), prompt_key=key)
        if not rest:
            return _Plan(matched)
        divergent = matched < len(self._units)
        return _Plan(matched, self._encode(rest, first=False), rest, Source.REWRITTEN if divergent else Source.USER,
                     divergent)

    def _encode(self, text_or_ids: str | tuple[int, ...], first: bool) -> list[int]:
        if isinstance(text_or_ids, tuple):
            return list(text_or_ids)
        return self.tokenizer(text_or_ids, add_special_tokens=first)["input_ids"]

    # ---- both ----------------------------------------------------------------------------------------------------

    def _check_kind(self, kind: str) -> None:
        if self._kind not in (None, kind):
            raise RequestError(f"this episode's session already serves {self._kind} requests; one episode uses "
                               f"either /v1/chat/completions or /v1/completions")
        self._kind = kind

    def _model_ids(self, unit: int) -> list[int]:
        start = self._units[unit - 1].end if unit > 0 else 0
        return self.episode.trajectory.response_ids[start:self._units[unit].end]

    async def _serve(self, plan: _Plan, params: SamplingParams, stop: Sequence[str], parse_calls: bool) -> Reply:
        if self.closed:
            raise RequestError(f"session {self.id} has ended (its episode finished or timed out)", 404,
                               "session_closed")
        start = time.perf_counter()
        traj = self.episode.trajectory
        self._apply(plan)
        traj.requests += 1
        traj.divergent_requests += plan.divergent
        prompt_tokens = len(traj.prompt_ids) + len(traj.response_ids)
        before = len(traj.response_ids)
        try:
            turn = await self.episode.generate(params)
        except AgentLoopError as err:  # the budget is spent, or the engine refused the turn
            raise RequestError(f"{err}", code="context_length_exceeded") from None
        ids, logprobs, text = turn.ids, traj.logprobs[before:], turn.text
        finish: Literal["stop", "length", "tool_calls"] = "length" if turn.finish_reason == "length" else "stop"
        cut = _stop_cut(ids, text, stop, self.tokenizer)
        if cut is not None:
            ids, logprobs, text = ids[:cut[0]], logprobs[:cut[0]], cut[1]
            traj.truncate(before + cut[0])
            finish = "stop"
        content, calls = text, []
        if parse_calls:
            parsed = self._parse(text)
            if parsed.calls and not parsed.errors:
                content, calls, finish = parsed.content, parsed.calls, "tool_calls"
        self._units.append(_Unit(self._reply_key(ids, text, content, calls), len(traj.response_ids), True))
        traj.request_seconds += time.perf_counter() - start
        return Reply(ids, logprobs, text, content, calls, finish, prompt_tokens)

    def _reply_key(self, ids: list[int], text: str, content: str, calls: list[FunctionCall]) -> tuple[Any, ...] | str:
        """What the client re-sends for a served turn: the assistant message, or the completion's text (its ids when
        the session's prompts are token ids)."""
        if self._kind == "chat":
            return (("assistant", content.strip(), _calls_key(calls)),)
        return text if isinstance(self._units[0].key, str) else tuple(ids)

    def finish(self) -> None:
        """Close the session (no more requests) and count the trajectory's turns as kept: retried and rewritten
        turns are gone from it."""
        self.closed = True
        traj = self.episode.trajectory
        traj.assistant_turns = sum(u.model for u in self._units)
        traj.user_turns = max(len(self._units) - 1 - traj.assistant_turns, 0)

    def _apply(self, plan: _Plan) -> None:
        """Cut the trajectory back to the kept units and add the new environment tokens, or start it anew; refused
        (nothing changed) when they would not fit the response budget with room for one model token."""
        traj, budget = self.episode.trajectory, self.episode.response_length
        if plan.prompt is not None:
            head, overflow = _split_prompt(plan.prompt, self._prompt_length)
            if len(overflow) >= budget:
                raise _too_long(len(plan.prompt), budget, self._prompt_length)
            traj.prompt_ids[:] = head
            traj.truncate(0)
            if overflow:
                traj.add_environment(overflow, Source.USER)
            self._units = [_Unit(plan.prompt_key, len(overflow), False)]
            return
        kept = self._units[plan.keep - 1].end
        if kept + len(plan.env) >= budget:
            raise _too_long(len(traj.prompt_ids) + kept + len(plan.env), budget, None)
        del self._units[plan.keep:]
        traj.truncate(kept)
        if plan.env:
            traj.add_environment(plan.env, plan.source)
            self._units.append(_Unit(plan.env_key, len(traj.response_ids), False))


def _split_prompt(ids: list[int], prompt_length: int | None) -> tuple[list[int], list[int]]:
    """An episode's first prompt as the trainer's batch holds it: the first `prompt_length` tokens in the prompt,
    the rest at the head of the response (environment tokens)."""
    if prompt_length is None or len(ids) <= prompt_length:
        return ids, []
    return ids[:prompt_length], ids[prompt_length:]


def _too_long(num_tokens: int, budget: int, prompt_length: int | None) -> RequestError:
    room = f"data.max_prompt_length={prompt_length} + " if prompt_length else ""
    return RequestError(f"the conversation is {num_tokens} tokens: an episode holds {room}"
                        f"data.max_response_length={budget} tokens (the model's turns and everything added after "
                        f"the first prompt), with room for the next turn", code="context_length_exceeded")


def _stop_cut(ids: list[int], text: str, stop: Sequence[str],
              tokenizer: PreTrainedTokenizerBase) -> tuple[int, str] | None:
    """Where a stop string ends the turn: (tokens kept, the text before the stop string), or None. The tokens kept
    are the fewest whose text contains the stop string (the model's turn ends with the token that completed it)."""
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not found:
        return None
    at = min(found)
    stop_text = next(s for s in stop if s and text.find(s) == at)
    low, high = 1, len(ids)  # decode(ids[:k]) contains the stop string for k = high, not for k < low
    while low < high:
        mid = (low + high) // 2
        if stop_text in tokenizer.decode(ids[:mid], skip_special_tokens=True):
            high = mid
        else:
            low = mid + 1
    return high, text[:at]
