"""The OpenAI-compatible endpoint on the rollout engine (`Endpoint`), and the agent loop that runs a user's agent
function against it (`EndpointAgentLoop`).

An existing agent program (its own loop, a LangGraph or smolagents agent, an SWE harness) trains unchanged: it gets
a base URL and talks to the policy with any OpenAI client. Each episode has its own URL
(`<server>/sessions/<id>/v1`), so the calls of one episode are tied together without the program's help (a shared
`/v1` with the `X-Shardrl-Session` header or the `user` field works too). The requests become turns of the
episode's trajectory on the same runner, engine and KV cache as the built-in loops, recorded token-exactly by its
`Session`, with the engine's log-probs and per-token policy versions; in the async modes a request in flight while
the weights change finishes under the new ones, versions recorded per token.

Served: `POST /v1/chat/completions` (messages, tools, tool_choice auto/none, temperature, top_p, max_tokens /
max_completion_tokens, stop, n=1, seed, logprobs, stream: the whole turn in one chunk when it ends), `POST
/v1/completions` and `GET /v1/models`. Anything else a request asks for that the endpoint cannot do (n > 1, top
log-probs, penalties, forced tool choice, JSON schemas) is a 400 naming the field, never ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardrl.agents.agent_host import AgentEpisode, AgentHost
from shardrl.agents.http_server import HttpError, HttpRequest, HttpResponse, HttpServer
from shardrl.agents.loop import AgentContext, AgentLoop, Episode
from shardrl.agents.render import TurnRenderer
from shardrl.agents.sessions import ChatMessage, Reply, RequestError, Session
from shardrl.rollout.request import SamplingParams

SESSION_HEADER = "x-shardrl-session"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the episode's budget
# Request fields the endpoint accepts only at the value that asks for nothing (a different value is refused).
_NEUTRAL = {"frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
            "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
            "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True), "n": (None, 1)}


@dataclass(frozen=True)
class EndpointSettings:
    """`actor_rollout_ref.rollout.agent.endpoint.*` (shardrl's), plus verl's `agent.num_workers`."""

    served_model_name: str = "policy"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port per rollout worker
    api_key: str | None = None
    max_body_mb: int = 8
    max_concurrent_requests: int = 1024
    episode_timeout: float = 600.0  # seconds per episode of the agent function
    memory_limit_mb: int | None = None  # per agent process
    num_workers: int = 8  # agent processes per rollout worker
    max_episodes_per_process: int = 64


class Endpoint:
    """The HTTP server of one rollout worker's runner and its sessions. Runs on the runner's event loop."""

    def __init__(self, settings: EndpointSettings, tokenizer: PreTrainedTokenizerBase, context: AgentContext,
                 template_kwargs: dict[str, Any]) -> None:
        self.settings, self.tokenizer, self.context = settings, tokenizer, context
        self._template_kwargs = template_kwargs
        self._renderers: dict[str, TurnRenderer] = {}
        self._sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.server = HttpServer(self.handle, host=settings.host, port=settings.port, api_key=settings.api_key,
                                 max_body_bytes=settings.max_body_mb << 20,
                                 max_concurrent_requests=settings.max_concurrent_requests)
        self._started: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind the server (once, whoever asks first)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.server.start())
        await asyncio.shield(self._started)

    async def close(self) -> None:
        if self._started is not None:
            await self.server.close()

    def open(self, episode: Episode) -> Session:
        session_id = f"s{next(self._ids)}"
        session = Session(session_id, episode, self.tokenizer, self._renderer, self.context.parse,
                          self.context.limits.prompt_length)
        self._sessions[session_id] = session
        return session

    async def end(self, session: Session) -> None:
        """No more requests for `session`; returns once the one in flight (if any) is done with the trajectory."""
        self._sessions.pop(session.id, None)
        session.closed = True
        async with session.lock:
            session.finish()

    def base_url(self, session: Session) -> str:
        return f"{self.server.base_url}/sessions/{session.id}/v1"

    def _renderer(self, tools: list[dict[str, Any]]) -> TurnRenderer:
        key = repr(tools)
        if key not in self._renderers:
            self._renderers[key] = TurnRenderer(self.tokenizer, tools, self._template_kwargs)
        return self._renderers[key]

    # ---- HTTP ----------------------------------------------------------------------------------------------------

    async def handle(self, request: HttpRequest) -> HttpResponse:
        session_id, path = _split_session(request.path)
        routes: dict[tuple[str, str], Callable[[HttpRequest, str | None], Any]] = {
            ("GET", "/v1/models"): self._models, ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions}
        route = routes.get((request.method, path))
        if route is None:
            known = {p for _, p in routes}
            status = 405 if path in known else 404
            raise HttpError(status, f"{request.method} {request.path}: not served; the endpoint serves GET /v1/models, "
                                    f"POST /v1/chat/completions and POST /v1/completions", code="not_found")
        try:
            return await route(request, session_id or request.headers.get(SESSION_HEADER))
        except RequestError as err:
            raise HttpError(err.status, str(err), param=err.param, code=err.code) from None

    async def _models(self, request: HttpRequest, session_id: str | None) -> HttpResponse:
        return HttpResponse(body={"object": "list", "data": [
            {"id": self.settings.served_model_name, "object": "model", "created": 0, "owned_by": "shardrl"}]})

    async def _chat(self, request: HttpRequest, session_id: str | None) -> HttpResponse:
        body = self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
        parsed = [ChatMessage.parse(m, i) for i, m in enumerate(messages)]
        tools = _tools(body.get("tools"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise RequestError(f"tool_choice={choice!r}: only 'auto' and 'none' are served (forcing a call needs "
                               f"constrained decoding)", param="tool_choice")
        session = self._session(session_id, body)
        async with session.lock:
            params = _sampling(body, session.episode, None)
            reply = await session.chat(parsed, tools, params, _stops(body), parse_calls=bool(tools) and choice == "auto")
        completion = _chat_completion(reply, self.settings.served_model_name, session, bool(body.get("logprobs")),
                                      self.tokenizer)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return HttpResponse(stream=_chat_chunks(completion, usage), headers={"cache-control": "no-cache"})
        return HttpResponse(body=completion)

    async def _completions(self, request: HttpRequest, session_id: str | None) -> HttpResponse:
        body = self._body(request)
        if body.get("stream"):
            raise RequestError("stream=true is served for chat completions only", param="stream")
        prompt = _prompt(body.get("prompt"))
        session = self._session(session_id, body)
        async with session.lock:
            params = _sampling(body, session.episode, COMPLETIONS_DEFAULT_MAX_TOKENS)
            reply = await session.complete(prompt, params, _stops(body))
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = [self.tokenizer.decode([t]) for t in reply.token_ids]
            offsets = list(itertools.accumulate([0, *map(len, tokens[:-1])]))
            logprobs = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        return HttpResponse(body={
            "id": f"cmpl-{session.id}-{session.episode.trajectory.requests}", "object": "text_completion",
            "created": int(time.time()), "model": self.settings.served_model_name,
            "choices": [{"index": 0, "text": reply.text, "logprobs": logprobs,
                         "finish_reason": "length" if reply.finish_reason == "length" else "stop"}],
            "usage": _usage(reply)})

    def _body(self, request: HttpRequest) -> dict[str, Any]:
        body = request.json()
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model != self.settings.served_model_name:
            raise RequestError(f"model={model!r}: this endpoint serves {self.settings.served_model_name!r} (the "
                               f"policy being trained; agent.endpoint.served_model_name)", 404, "model_not_found",
                               "model")
        for name, neutral in _NEUTRAL.items():
            if name in body and body[name] not in neutral:
                raise RequestError(f"{name}={body[name]!r} is not served by the training endpoint; leave it out",
                                   param=name)
        return body

    def _session(self, session_id: str | None, body: dict[str, Any]) -> Session:
        session_id = session_id or (body.get("user") if isinstance(body.get("user"), str) else None)
        if session_id is None:
            raise RequestError("no session: use the episode's base_url (…/sessions/<id>/v1), or send its id in the "
                               f"{SESSION_HEADER} header or the `user` field", code="session_required")
        session = self._sessions.get(session_id)
        if session is None:
            raise RequestError(f"session {session_id!r} is not open (it never was, or its episode has ended)", 404,
                               "session_closed")
        return session


def _split_session(path: str) -> tuple[str | None, str]:
    """`/sessions/<id>/v1/...` -> (id, `/v1/...`); other paths are served as they are, without a session."""
    parts = path.split("/", 3)
    if len(parts) == 4 and parts[1] == "sessions" and parts[2]:
        return parts[2], "/" + parts[3]
    return None, path.rstrip("/") or "/"


def _number(body: dict[str, Any], name: str, low: float, high: float, integer: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not kind_ok or not (low <= value <= high) or not math.isfinite(value):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{name}={value!r}: must be {kind} in [{low:g}, {high:g}]", param=name)
    return value


def _sampling(body: dict[str, Any], episode: Episode, default_max_tokens: int | None) -> SamplingParams:
    """The request's sampling settings over the run's (`rollout.temperature`, `top_p`, `top_k` where the request
    sets none). What the request sets is what is sampled from, and the behaviour log-probs are those of it: an
    agent that sets its own temperature is off-policy to the trainer's recomputation, which rollout correction
    (`algorithm.rollout_correction`) accounts for."""
    base = episode.sample.params
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 1e-9, 1.0)
    seed = _number(body, "seed", -(2 ** 63), 2 ** 63 - 1, integer=True)
    limits = [_number(body, key, 1, 2 ** 31, integer=True) for key in ("max_tokens", "max_completion_tokens")]
    chosen = [v for v in limits if v is not None]
    max_tokens = int(min(chosen)) if chosen else default_max_tokens or episode.remaining
    return replace(base, temperature=base.temperature if temperature is None else float(temperature),
                   top_p=base.top_p if top_p is None else float(top_p), seed=base.seed if seed is None else int(seed),
                   max_tokens=max(1, min(max_tokens, episode.remaining)), n=1)


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return stops


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {type: function, function: {name, parameters}}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                               param="tools")
    return tools


def _prompt(prompt: Any) -> str | list[int]:
    """A completion's prompt: a string or token ids, or a list holding one of them (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise RequestError("prompt must be a non-empty string or list of token ids (one prompt per request)",
                       param="prompt")


def _usage(reply: Reply) -> dict[str, int]:
    completion = len(reply.token_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": completion,
            "total_tokens": reply.prompt_tokens + completion}


def _chat_completion(reply: Reply, model: str, session: Session, logprobs: bool,
                     tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    number = session.episode.trajectory.requests
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.calls:
        message["tool_calls"] = [
            {"id": f"call_{session.id}_{number}_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(reply.calls)]
    else:
        message["content"] = reply.content
    content_logprobs = None
    if logprobs:
        content_logprobs = {"content": [
            {"token": (piece := tokenizer.decode([t])), "logprob": lp, "bytes": list(piece.encode()),
             "top_logprobs": []} for t, lp in zip(reply.token_ids, reply.logprobs)]}
    return {"id": f"chatcmpl-{session.id}-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": content_logprobs,
                                         "finish_reason": reply.finish_reason}],
            "usage": _usage(reply)}


async def _chat_chunks(completion: dict[str, Any], usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The completion as stream chunks: the whole turn (it is sampled before it is served), then its end."""
    choice = completion["choices"][0]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    yield head | {"choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]}
    yield head | {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}
    if usage:
        yield head | {"choices": [], "usage": completion["usage"]}


class EndpointAgentLoop(AgentLoop):
    """An agent function (`file.py:function` or `package.module:function` in `agent.agent_loop_config_path`) run
    in the agent processes (`AgentHost`) against this worker's endpoint, one session per episode. It returns the
    episode's reward, or None to leave scoring to the reward function. An exception, a timeout or a crash fails
    only its episode (marked, counted: `agent/loop_errors`), whose session then refuses further requests."""

    def __init__(self, context: AgentContext, endpoint: Endpoint, host: AgentHost) -> None:
        super().__init__(context)
        self.endpoint, self.host = endpoint, host
        self._episodes = itertools.count()

    async def run(self, episode: Episode) -> None:
        await self.endpoint.start()
        session = self.endpoint.open(episode)
        traj, sample = episode.trajectory, episode.sample
        traj.external = True
        settings = self.endpoint.settings
        request = AgentEpisode(self.endpoint.base_url(session), settings.api_key or "none",
                               settings.served_model_name, sample.messages, self.context.toolbox.schemas,
                               sample.extra_info, episode.response_length, next(self._episodes))
        try:
            result = await self.host.run(request)
        finally:
            await self.endpoint.end(session)
        traj.agent_reward = result.reward
        if result.error is not None:
            traj.error, traj.finish_reason = result.error, "timeout" if result.timed_out else "error"
        elif not traj.requests:
            traj.error, traj.finish_reason = f"{self.name}: the agent function made no request", "error"

    async def aclose(self) -> None:
        self.host.close()
        await self.endpoint.close()
