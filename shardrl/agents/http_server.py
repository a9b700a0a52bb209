"""A small asyncio HTTP/1.1 server: the HTTP layer of the OpenAI-compatible endpoint in front of the rollout engine.

The standard library has no asyncio HTTP server (`http.server` blocks a thread per request), and the endpoint must run
on the rollout runner's own event loop, so that a request reaches the engine without a thread hop and a stream goes out
as the engine yields it. The OpenAI routes live in the handler; this module only speaks HTTP. It guarantees:

- keep-alive, with the requests of one connection answered one at a time, in order; `Connection: close` and HTTP/1.0
  close after the response; request bodies by Content-Length or chunked; `Expect: 100-continue` answered first;
- every refusal is JSON in OpenAI's error shape: 400 bad framing, 431 head too large, 413 body too large (refused
  before it is read), 401 bad API key, 429 too many requests in flight, a handler's `HttpError` as raised, 500 for any
  other handler exception (logged); after 400/413/431 the connection closes, after the others it stays usable;
- a client that goes away costs nothing else: its handler runs to the end and the answer is dropped (a stream is
  closed at its next event); only `close()` cancels handlers, and afterwards no task of the server is left;
- it runs on any running loop in any thread (no signal handlers) and writes nothing to stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http.client
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

logger = logging.getLogger(__name__)

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: methods and header names
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_LINGER_SECONDS = 1.0  # how long a refused connection may keep sending before it is closed under it
_READ_BYTES = 1 << 16


class HttpError(Exception):
    """A request the server refuses: status (4xx/5xx), a one-line message, an OpenAI error `type` and optional
    `param`/`code`. Handlers raise it to answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass(frozen=True)
class HttpRequest:
    """One parsed request, body read in full, as the handler sees it."""

    method: str  # upper case
    path: str  # without the query string, percent-decoded
    query: dict[str, str]
    headers: dict[str, str]  # names lower-cased; repeated headers joined with ", "
    body: bytes

    def json(self) -> Any:
        """The decoded JSON body; HttpError(400) if the body is not UTF-8 JSON, so routes need no parsing guard."""
        try:
            return json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise HttpError(400, f"request body is not UTF-8 JSON: {error}") from None


@dataclass
class HttpResponse:
    """What a handler answers: a JSON body (None: an empty body) or a stream sent as server-sent events."""

    status: int = 200
    body: Any = None  # JSON-able, sent as application/json
    stream: AsyncIterator[Any] | None = None  # each item a JSON-able value sent as `data: <json>\n\n`, then [DONE]
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class HttpServer:
    """Serves `handler` on the running event loop; see the module docstring for what it guarantees."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = 8 << 20, max_concurrent_requests: int = 1024,
                 max_header_bytes: int = 64 << 10) -> None:
        limits = dict(max_body_bytes=max_body_bytes, max_concurrent_requests=max_concurrent_requests,
                      max_header_bytes=max_header_bytes)
        if bad := {name: value for name, value in limits.items() if value < 1}:
            raise ValueError(f"HttpServer limits {bad}: each must be at least 1")
        self._handler, self._host, self._port, self._api_key = handler, host, port, api_key
        self._max_body_bytes, self._max_header_bytes = max_body_bytes, max_header_bytes
        self._max_concurrent_requests = max_concurrent_requests
        self._server: asyncio.Server | None = None
        self._closing = False
        self._in_flight = 0
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        """Bind (port 0: a free port) and serve on the running loop. A host name with several addresses binds each."""
        if self._server is not None:
            raise RuntimeError("HttpServer.start() called twice; create a new HttpServer instead")
        self._server = await asyncio.start_server(self._on_connect, self._host, self._port,
                                                  limit=self._max_header_bytes)
        self._port = self._server.sockets[0].getsockname()[1]  # kept: the sockets are gone after close()

    @property
    def port(self) -> int:
        """The bound port (the first socket's, when the host had several addresses)."""
        if self._server is None:
            raise RuntimeError("HttpServer.port read before start(); await server.start() first")
        return self._port

    @property
    def base_url(self) -> str:
        """What a client (the `openai` package's `base_url` less `/v1`) connects to."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, close every connection and cancel its handler, and wait until all of them have finished."""
        self._closing = True
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            self._connections[task].close()
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve a connection in a task recorded before it first runs, so close() reaches every connection."""
        if self._closing:  # accepted in the instant of closing
            writer.close()
            return
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._connections[task] = writer
        task.add_done_callback(self._connections.pop)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the requests of one connection until either side closes it."""
        try:
            while await self._exchange(reader, writer):
                pass
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away; whatever it was still owed is dropped
        finally:
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read one request and answer it; whether the connection stays open for the next one."""
        try:
            received = await self._read_request(reader, writer)
        except HttpError as error:
            writer.write(_encode(_error_response(error), keep_alive=False))
            await writer.drain()
            await _linger(reader, writer)
            return False
        if received is None:
            return False
        request, keep_alive = received
        refusal = self._refusal(request)
        if refusal is not None:
            writer.write(_encode(refusal, keep_alive))
            await writer.drain()
            return keep_alive
        self._in_flight += 1
        try:
            head, stream = await self._answer(request, keep_alive)
            writer.write(head)
            await writer.drain()
            if stream is not None:
                await _send_events(writer, stream, chunked=keep_alive)
        finally:
            self._in_flight -= 1
        return keep_alive

    async def _read_request(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> tuple[HttpRequest, bool] | None:
        """The next request and whether to keep the connection after it; None when the client closed first."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request line and headers exceed {self._max_header_bytes} bytes") from None
        method, target, version, headers = _parse_head(head)
        body = await self._read_body(reader, writer, version, headers)
        request = HttpRequest(method, *_split_target(target), headers, body)
        tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
        return request, version == "HTTP/1.1" and "close" not in tokens

    async def _read_body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: str,
                         headers: dict[str, str]) -> bytes:
        """The body the headers frame, refused (413) before it is read when its declared length is too large."""
        chunked = "transfer-encoding" in headers
        if chunked and headers["transfer-encoding"].lower() != "chunked":
            raise HttpError(501, f"Transfer-Encoding {headers['transfer-encoding']!r} is not supported; use chunked")
        if chunked and "content-length" in headers:
            raise HttpError(400, "request has both Content-Length and Transfer-Encoding; send one of them")
        length = 0 if chunked else _content_length(headers.get("content-length", "0"))
        if length > self._max_body_bytes:
            raise HttpError(413, f"request body of {length} bytes exceeds the limit of {self._max_body_bytes}")
        if (chunked or length) and version == "HTTP/1.1" and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        return await self._read_chunked(reader) if chunked else await reader.readexactly(length)

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        """A chunked body, refused (413) at the first chunk that takes it past the limit; trailers are dropped."""
        body = bytearray()
        while size := _chunk_size(await _read_line(reader)):
            if len(body) + size > self._max_body_bytes:
                raise HttpError(413, f"chunked request body exceeds the limit of {self._max_body_bytes} bytes")
            body += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise HttpError(400, f"malformed chunked body: a {size}-byte chunk is not followed by CRLF")
        while await _read_line(reader):
            pass
        return bytes(body)

    def _refusal(self, request: HttpRequest) -> HttpResponse | None:
        """The 401 or 429 a request gets before it reaches the handler, or None to let it through."""
        if self._api_key is not None and not _bearer_matches(request.headers.get("authorization", ""), self._api_key):
            error = HttpError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
            return _error_response(error, {"WWW-Authenticate": "Bearer"})
        if self._in_flight >= self._max_concurrent_requests:
            error = HttpError(429, f"{self._in_flight} requests already in flight, the server's limit; retry in 1 s",
                              type="rate_limit_error", code="rate_limit_exceeded")
            return _error_response(error, {"Retry-After": "1"})
        return None

    async def _answer(self, request: HttpRequest, keep_alive: bool) -> tuple[bytes, AsyncIterator[Any] | None]:
        """The encoded head (and JSON body) plus the stream to follow; encoding inside the guard makes a body that is
        not JSON-able a 500 rather than a dropped connection."""
        try:
            response = await self._handler(request)
            return _encode(response, keep_alive), response.stream
        except Exception as error:
            return _encode(_error_response(_failure(error, f"handler for {request.method} {request.path}")),
                           keep_alive), None


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """(method, target, version, headers) of a request head; HttpError(400) naming the first malformed line."""
    request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1] or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(400, f"malformed request line {request_line[:200]!r}; expected 'METHOD /path HTTP/1.1'")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name) or "\r" in value or "\n" in value:
            raise HttpError(400, f"malformed header line {line[:200]!r}; expected 'Name: value'")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return parts[0].upper(), parts[1], parts[2], headers


def _split_target(target: str) -> tuple[str, dict[str, str]]:
    """Path and query of an origin-form (`/p?q`) or absolute-form (`http://h/p?q`) target. Origin-form is split by
    hand: urlsplit would read `//v1/models` as host `v1`."""
    if not target.startswith("/"):
        url = urlsplit(target)
        target = f"{url.path or '/'}?{url.query}"
    path, _, query = target.partition("?")
    return unquote(path), dict(parse_qsl(query, keep_blank_values=True))


def _content_length(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise HttpError(400, f"malformed Content-Length {value[:50]!r}; expected a number of bytes")
    return int(value)


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    """One CRLF-terminated line of chunked framing, without the CRLF."""
    try:
        return (await reader.readuntil(b"\r\n"))[:-2]
    except asyncio.LimitOverrunError:
        raise HttpError(400, "malformed chunked body: a chunk-size or trailer line is too long") from None


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip(b" \t")
    if not _CHUNK_SIZE.fullmatch(digits):
        raise HttpError(400, f"malformed chunked body: bad chunk-size line {line[:50]!r}")
    return int(digits, 16)


def _bearer_matches(authorization: str, api_key: str) -> bool:
    """compare_digest takes as long whatever the token, so timing does not reveal how much of the key matched."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode("latin-1"), api_key.encode("utf-8"))


def _failure(error: Exception, where: str) -> HttpError:
    """The error a client sees for a failed handler or stream; anything but an HttpError is a server bug, logged."""
    if isinstance(error, HttpError):
        return error
    logger.error("%s raised %s", where, type(error).__name__, exc_info=error)
    return HttpError(500, " ".join(f"internal error: {type(error).__name__}: {error}".split()), type="server_error")


def _error_response(error: HttpError, headers: dict[str, str] | None = None) -> HttpResponse:
    return HttpResponse(error.status, _error_body(error), headers=headers or {})


def _error_body(error: HttpError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def _encode(response: HttpResponse, keep_alive: bool) -> bytes:
    """The status line and headers, then the JSON body unless the response is a stream. A stream on a connection that
    closes afterwards is close-delimited, which HTTP/1.0 clients (no chunked encoding) understand too."""
    framing = {"Connection": "keep-alive" if keep_alive else "close"}
    if response.stream is not None:
        defaults, body = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}, b""
        if keep_alive:
            framing["Transfer-Encoding"] = "chunked"
    else:
        body = b"" if response.body is None else json.dumps(response.body).encode()
        defaults = {"Content-Type": "application/json"} if body else {}
        framing["Content-Length"] = str(len(body))
    fields = {name.lower(): (name, value)  # later parts win, whatever the case of the name
              for part in (defaults, response.headers, framing) for name, value in part.items()}
    lines = [f"HTTP/1.1 {response.status} {http.client.responses.get(response.status, '')}"]
    lines += [f"{name}: {value}" for name, value in fields.values()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _send_events(writer: asyncio.StreamWriter, stream: AsyncIterator[Any], chunked: bool) -> None:
    """Write each event as it comes (draining, so a vanished client raises here rather than buffering forever)."""
    async with contextlib.aclosing(_events(stream)) as frames:
        async for frame in frames:
            writer.write(b"%x\r\n%s\r\n" % (len(frame), frame) if chunked else frame)
            await writer.drain()
    if chunked:
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _events(stream: AsyncIterator[Any]) -> AsyncGenerator[bytes, None]:
    """The stream's server-sent events, then [DONE]. A failure part-way (the status is already sent) becomes a last
    error event; the stream is closed however this ends, so a generator behind a vanished client stops producing."""
    try:
        async for item in stream:
            yield b"data: %s\n\n" % json.dumps(item).encode()
        yield b"data: [DONE]\n\n"
    except Exception as error:
        yield b"data: %s\n\n" % json.dumps(_error_body(_failure(error, "response stream"))).encode()
    finally:
        if isinstance(stream, AsyncGenerator):
            await stream.aclose()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then drop what the client still sends for a moment: closing with unread input resets the
    connection, which can destroy the error response before the client reads it."""
    writer.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(_LINGER_SECONDS):
            while await reader.read(_READ_BYTES):
                pass
