"""The HTTP layer of the OpenAI-compatible endpoint, driven with raw sockets and http.client while its event loop runs
in a background thread, as the rollout runner runs it: framing, keep-alive, limits, errors in OpenAI's shape,
clients that vanish, and a close() that leaves neither the port nor a task behind."""

import asyncio
import http.client
import json
import socket
import threading

import pytest

from shardrl.agents.http_server import HttpError, HttpRequest, HttpResponse, HttpServer

TIMEOUT = 5.0  # a broken server fails a test by this socket timeout instead of hanging it


def run(loop, coroutine):
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(TIMEOUT)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(TIMEOUT)
    loop.close()


async def echo(request: HttpRequest) -> HttpResponse:
    """Routes: /json decodes the body, /boom and /teapot fail, /stream and /stream-fails stream, anything else
    echoes the request."""
    if request.path == "/json":
        return HttpResponse(body=request.json())
    if request.path == "/boom":
        raise ValueError("bad\nvalue")
    if request.path == "/teapot":
        raise HttpError(418, "short and stout", code="teapot")
    if request.path == "/stream":
        return HttpResponse(stream=numbers(3))
    if request.path == "/stream-fails":
        return HttpResponse(stream=numbers(1, then=RuntimeError("engine died")))
    return HttpResponse(body={"method": request.method, "path": request.path, "query": request.query,
                              "body": request.body.decode()}, headers={"X-Route": "echo"})


async def numbers(count, then=None):
    for n in range(count):
        await asyncio.sleep(0)
        yield {"n": n}
    if then is not None:
        raise then


@pytest.fixture
def start(loop):
    """start(handler, **options) -> a running server, closed after the test."""
    servers = []

    def start(handler=echo, **options):
        server = HttpServer(handler, **options)
        run(loop, server.start())
        servers.append(server)
        return server

    yield start
    for server in servers:
        run(loop, server.close())


class Client:
    """A raw connection whose responses are read from one buffered file; close() hangs up for real (a socket with a
    file open on it keeps its descriptor)."""

    def __init__(self, server):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
        self.file = self.sock.makefile("rb")

    def send(self, data):
        self.sock.sendall(data)

    def response(self):
        return read_response(self.file)

    def close(self):
        self.file.close()
        self.sock.close()


def request(method, path, body=b"", headers=(), version="HTTP/1.1"):
    lines = [f"{method} {path} {version}", "Host: test", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(file):
    """(status, headers, body) of one response with a Content-Length body, or one that ends at the close."""
    status = int(file.readline().split()[1])
    headers = {}
    while (line := file.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    body = file.read(int(headers["content-length"])) if "content-length" in headers else file.read()
    return status, headers, body


def error_of(body):
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_keep_alive_answers_pipelined_requests_in_order_on_one_connection(start):
    server = start()
    client = Client(server)
    client.send(b"".join(request("GET", f"/{name}?k={name}") for name in "abc"))
    for name in "abc":
        status, headers, body = client.response()
        assert status == 200 and headers["connection"] == "keep-alive"
        assert headers["content-type"] == "application/json" and headers["x-route"] == "echo"
        assert json.loads(body) == {"method": "GET", "path": f"/{name}", "query": {"k": name}, "body": ""}
    client.close()


@pytest.mark.parametrize("version, headers", [("HTTP/1.1", ["Connection: close"]), ("HTTP/1.0", [])])
def test_connection_close_and_http_1_0_close_after_the_response(start, version, headers):
    client = Client(start())
    client.send(request("GET", "/x", headers=headers, version=version) + request("GET", "/never"))
    status, response_headers, _ = client.response()
    assert status == 200 and response_headers["connection"] == "close"
    assert client.file.read() == b""  # closed; the second request was not answered
    client.close()


def test_path_is_percent_decoded_and_split_from_the_query_and_method_upper_cased(start):
    client = Client(start())
    client.send(request("post", "/a%20b?q=x%26y&empty=") + request("GET", "//v1/models")
                + request("GET", "http://host/abs?x=1"))
    echoed = json.loads(client.response()[2])
    assert echoed == {"method": "POST", "path": "/a b", "query": {"q": "x&y", "empty": ""}, "body": ""}
    assert json.loads(client.response()[2])["path"] == "//v1/models"
    assert json.loads(client.response()[2])["query"] == {"x": "1"}
    client.close()


def test_chunked_request_body_is_joined_and_the_connection_stays_in_step(start):
    client = Client(start())
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n" + request("GET", "/next"))
    assert json.loads(client.response()[2])["body"] == "hello world"
    assert json.loads(client.response()[2])["path"] == "/next"
    client.close()


def test_expect_100_continue_is_answered_before_the_body_is_sent(start):
    client = Client(start())
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert client.file.readline() == b"HTTP/1.1 100 Continue\r\n" and client.file.readline() == b"\r\n"
    client.send(b"hello")
    status, _, body = client.response()
    assert status == 200 and json.loads(body)["body"] == "hello"
    client.close()


def test_oversize_body_is_413_unread_and_the_server_serves_on(start):
    calls = []

    async def handler(request):
        calls.append(request.path)
        return HttpResponse(body="ok")

    server = start(handler, max_body_bytes=100)
    client = Client(server)
    # declares a gigabyte and sends none of it: an answer at all proves the body was not read
    client.send(b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n")
    status, headers, body = client.response()
    assert status == 413 and headers["connection"] == "close" and "limit of 100" in error_of(body)["message"]
    assert client.file.read() == b"" and calls == []
    client.close()
    client = Client(server)
    client.send(request("POST", "/small", b"x" * 100))
    assert client.response()[:1] == (200,) and calls == ["/small"]
    client.close()


def test_chunked_body_over_the_limit_is_413(start):
    client = Client(start(max_body_bytes=8))
    client.send(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n")
    status, _, body = client.response()
    assert status == 413 and error_of(body)["type"] == "invalid_request_error"
    client.close()


def test_headers_over_the_limit_are_431(start):
    client = Client(start(max_header_bytes=1024))
    client.send(request("GET", "/", headers=["X-Big: " + "a" * 4096]))
    status, headers, body = client.response()
    assert status == 431 and headers["connection"] == "close" and "1024" in error_of(body)["message"]
    client.close()


@pytest.mark.parametrize("raw", [
    b"NOT A REQUEST LINE AT ALL\r\n\r\n",
    b"GET /\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\n",
    b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY",
], ids=["words", "no-version", "http2", "header", "content-length", "chunk-size", "chunk-end"])
def test_malformed_framing_is_400_and_closes(start, raw):
    client = Client(start())
    client.send(raw + request("GET", "/never"))
    status, headers, body = client.response()
    assert status == 400 and headers["connection"] == "close"
    assert error_of(body)["type"] == "invalid_request_error" and "malformed" in error_of(body)["message"]
    assert client.file.read() == b""
    client.close()


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe"])
def test_body_that_is_not_utf8_json_is_400_with_a_one_line_message(start, body):
    client = Client(start())
    client.send(request("POST", "/json", body) + request("POST", "/json", b'{"a": [1, 2]}'))
    status, headers, response = client.response()
    message = error_of(response)["message"]
    assert status == 400 and message.startswith("request body is not UTF-8 JSON") and "\n" not in message
    assert headers["connection"] == "keep-alive"
    assert client.response()[0::2] == (200, b'{"a": [1, 2]}')
    client.close()


def test_api_key_is_required_when_set(start):
    server = start(api_key="sk-right")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    for headers in [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}]:
        connection.request("GET", "/", headers=headers)
        response = connection.getresponse()
        error = error_of(response.read())
        assert response.status == 401 and error["code"] == "invalid_api_key"
    connection.request("GET", "/", headers={"Authorization": "Bearer sk-right"})
    assert connection.getresponse().status == 200
    connection.close()


def test_requests_past_the_concurrency_limit_are_429(start, loop):
    entered, release = threading.Event(), asyncio.Event()

    async def handler(request):
        if request.path == "/hold":
            entered.set()
            await release.wait()
        return HttpResponse(body=request.path)

    server = start(handler, max_concurrent_requests=1)
    held = Client(server)
    held.send(request("GET", "/hold"))
    assert entered.wait(TIMEOUT)
    client = Client(server)
    client.send(request("GET", "/second"))
    status, headers, body = client.response()
    assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "keep-alive"
    assert error_of(body)["code"] == "rate_limit_exceeded"
    loop.call_soon_threadsafe(release.set)
    assert held.response()[0::2] == (200, b'"/hold"')
    client.send(request("GET", "/third"))  # the slot is free again, on the same connection
    assert client.response()[0::2] == (200, b'"/third"')
    held.close()
    client.close()


def test_handler_exceptions_become_errors_and_the_connection_serves_on(start, caplog, capsys):
    client = Client(start())
    client.send(request("GET", "/boom") + request("GET", "/teapot") + request("GET", "/after"))
    status, _, body = client.response()
    error = error_of(body)
    assert status == 500 and error["message"] == "internal error: ValueError: bad value"
    assert error["type"] == "server_error"
    status, _, body = client.response()
    assert status == 418 and error_of(body) == {"message": "short and stout", "type": "invalid_request_error",
                                                "param": None, "code": "teapot"}
    assert client.response()[0] == 200
    client.close()
    [record] = [r for r in caplog.records if r.name == "shardrl.agents.http_server"]
    assert record.levelname == "ERROR" and record.exc_info[0] is ValueError
    assert capsys.readouterr().out == ""


def test_stream_is_sent_as_server_sent_events_ending_in_done(start):
    connection = http.client.HTTPConnection("127.0.0.1", start().port, timeout=TIMEOUT)
    connection.request("GET", "/stream")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    assert response.getheader("Transfer-Encoding") == "chunked"
    assert response.read() == b'data: {"n": 0}\n\ndata: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    sock = connection.sock
    connection.request("GET", "/stream-fails")  # the status is sent: a failure part-way is a last error event
    assert connection.getresponse().read() == b'data: {"n": 0}\n\ndata: {"error": {"message": "internal error: ' \
        b'RuntimeError: engine died", "type": "server_error", "param": null, "code": null}}\n\n'
    connection.request("GET", "/after")  # the chunked framing ended cleanly: the connection is reused
    assert connection.getresponse().status == 200 and connection.sock is sock
    connection.close()


def test_clients_that_vanish_do_not_stop_the_server_nor_cancel_handlers(start, loop):
    release, finished, cancelled, stream_closed = asyncio.Event(), threading.Event(), [], threading.Event()

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.001)
                yield "tick"
        finally:
            stream_closed.set()

    async def handler(request):
        if request.path == "/slow":
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancelled.append(request.path)
                raise
            finished.set()
        return HttpResponse(stream=endless() if request.path == "/endless" else None)

    def served():
        client = Client(server)
        client.send(request("GET", "/"))
        status = client.response()[0]
        client.close()
        return status

    server = start(handler)
    client = Client(server)
    client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly ten b")  # mid-body
    client.close()
    assert served() == 200
    client = Client(server)
    client.send(request("GET", "/slow"))  # mid-handler
    client.close()
    assert served() == 200  # meanwhile the server has seen the hang-up
    loop.call_soon_threadsafe(release.set)
    assert finished.wait(TIMEOUT) and cancelled == []  # ran to the end; its answer was dropped
    client = Client(server)
    client.send(request("GET", "/endless"))  # mid-stream
    assert client.file.readline().startswith(b"HTTP/1.1 200")
    client.close()
    assert stream_closed.wait(TIMEOUT)  # the stream was closed, not left producing for nobody
    assert served() == 200


def test_close_frees_the_port_cancels_handlers_and_leaves_no_task(start, loop):
    cancelled = threading.Event()
    entered = threading.Event()

    async def handler(request):
        if request.path == "/forever":
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return HttpResponse(body="ok")

    server = start(handler)
    idle = Client(server)
    idle.send(request("GET", "/"))
    assert idle.response()[0] == 200  # a kept-alive connection, now idle
    busy = Client(server)
    busy.send(request("GET", "/forever"))
    assert entered.wait(TIMEOUT)
    run(loop, server.close())
    assert cancelled.is_set()
    assert idle.file.read() == b"" and busy.file.read() == b""

    async def other_tasks():
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert run(loop, other_tasks()) == set()
    again = start(port=server.port)
    assert again.port == server.port and again.base_url == f"http://127.0.0.1:{server.port}"
    idle.close()
    busy.close()
