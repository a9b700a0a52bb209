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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardrl.agents.agent_host import AgentEpisode, AgentHost
from shardrl.agents.http_server import HttpError, HttpRequest, HttpResponse, HttpServer
from shardrl.agents.loop import AgentContext, AgentLoop, Episode
from shardrl.agents.openai_api import (COMPLETIONS_DEFAULT_MAX_TOKENS, chat_chunks, chat_completion, prompt_of,
                                       refuse_unserved, sampling_of, stops_of, text_completion, tools_of)
from shardrl.agents.render import TurnRenderer
from shardrl.agents.sessions import ChatMessage, RequestError, Session

SESSION_HEADER = "x-shardrl-session"


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
        tools = tools_of(body.get("tools"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise RequestError(f"tool_choice={choice!r}: only 'auto' and 'none' are served (forcing a call needs "
                               f"constrained decoding)", param="tool_choice")
        session = self._session(session_id, body)
        async with session.lock:
            params = sampling_of(body, session.episode, None)
            reply = await session.chat(parsed, tools, params, stops_of(body), parse_calls=bool(tools) and choice == "auto")
        completion = chat_completion(reply, self.settings.served_model_name, session.id,
                                     session.episode.trajectory.requests, bool(body.get("logprobs")), self.tokenizer)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return HttpResponse(stream=chat_chunks(completion, usage), headers={"cache-control": "no-cache"})
        return HttpResponse(body=completion)

    async def _completions(self, request: HttpRequest, session_id: str | None) -> HttpResponse:
        body = self._body(request)
        if body.get("stream"):
            raise RequestError("stream=true is served for chat completions only", param="stream")
        prompt = prompt_of(body.get("prompt"))
        session = self._session(session_id, body)
        async with session.lock:
            params = sampling_of(body, session.episode, COMPLETIONS_DEFAULT_MAX_TOKENS)
            reply = await session.complete(prompt, params, stops_of(body))
        return HttpResponse(body=text_completion(reply, self.settings.served_model_name,
                                                 f"cmpl-{session.id}-{session.episode.trajectory.requests}",
                                                 body.get("logprobs") is not None, self.tokenizer))

    def _body(self, request: HttpRequest) -> dict[str, Any]:
        body = request.json()
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model != self.settings.served_model_name:
            raise RequestError(f"model={model!r}: this endpoint serves {self.settings.served_model_name!r} (the "
                               f"policy being trained; agent.endpoint.served_model_name)", 404, "model_not_found",
                               "model")
        refuse_unserved(body)
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
