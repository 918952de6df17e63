"""The agents' endpoint's HTTP layer: hypercorn's HTTP/1.1 protocol on trio (h11 underneath) serving a
small ASGI adapter around one handler, with the limits a server on an open network needs.

A handler gets one `HttpRequest` (its whole body read) and returns an `HttpResponse`, or a `Streamed`
one whose body is written in chunks as they come (server-sent events). Connections are kept alive
between requests, as HTTP clients (httpx, under the `openai` package) expect. A handler that raises
answers 500 and the server goes on, unless what it raised is one of `serve`'s `fatal` exceptions:
that request is answered 503 and the server ends, raising it (the replica's engine died: no request
can be served any more). What a client cannot do (`Limits`): hold a connection with no request under
way, or send a request's head, longer than `keep_alive_s` (the connection is closed); take longer
than `read_timeout_s` over a request's body (408); send a body over `max_body` bytes (413); open
more than `max_connections` at once (503 with Retry-After, then closed). HTTP that does not parse
is answered 400 and its connection closed.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

log = logging.getLogger("rlflow.agents")

#: The header of an episode take's answer that says how many episodes its replica has left to hand out
#: (the router sends takes where episodes wait).
QUEUED = "rlflow-queued"


@dataclass(frozen=True)
class Limits:
    """What one client may take of the server (see the module's docstring)."""

    keep_alive_s: float = 30.0
    read_timeout_s: float = 60.0
    max_body: int = 16 << 20
    """A long conversation with its tools is well under it."""
    max_connections: int = 4096
    grace_s: float = 2.0
    """How long answers already given may take to reach their clients once the server ends."""


@dataclass
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, status: int, value: Any) -> HttpResponse:
        return cls(status, json.dumps(value).encode())

    @classmethod
    def error(cls, status: int, message: str, kind: str) -> HttpResponse:
        """The OpenAI API's error body."""
        return cls.of(status, {"error": {"message": message, "type": kind, "code": kind}})


@dataclass
class Streamed:
    """A response written as its chunks come."""

    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=lambda: [("cache-control", "no-cache")])


Handler = Callable[[HttpRequest], Awaitable[HttpResponse | Streamed]]


class Drain:
    """Requests of a server under way, from read to answer written: `idle` waits until there are none,
    so that answers given while a server stops reach their clients before it does."""

    def __init__(self) -> None:
        self.busy = 0
        self._idle = trio.Event()

    def start(self) -> None:
        self.busy += 1

    def done(self) -> None:
        self.busy -= 1
        if not self.busy:
            self._idle.set()
            self._idle = trio.Event()

    async def idle(self) -> None:
        while self.busy:
            await self._idle.wait()


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port) (port 0: one the system picks), for `serve`: clients that
    connect before it serves wait in its backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(handler: Handler, sock: socket.socket, *, fatal: tuple[type[Exception], ...] = (),
                drain: Drain | None = None, limits: Limits = Limits(),
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `handler` on the listening socket `sock` (see `bind`) until cancelled, or until the handler
    raises one of `fatal`, which `serve` raises then; `drain` counts the requests under way."""
    ended: list[Exception] = []
    stop = trio.Event()

    def end(exc: Exception) -> None:
        ended.append(exc)
        stop.set()

    app = wrap_app(_App(handler, fatal, drain or Drain(), limits, end), limits.max_body, "asgi")
    config = _config(limits)
    context = WorkerContext(None)
    room = trio.CapacityLimiter(limits.max_connections)

    async def connection(stream: trio.SocketStream) -> None:
        try:
            room.acquire_nowait()
        except trio.WouldBlock:
            await _turn_away(stream, limits.max_connections)
            return
        try:
            await _Connection(app, config, context, ConnectionState({}), stream)  # type: ignore[arg-type]
        finally:
            room.release()

    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    async with trio.open_nursery() as connections:
        async with listener, trio.open_nursery() as accepting:
            await accepting.start(functools.partial(trio.serve_listeners, handler_nursery=connections), connection,
                                  [listener])
            task_status.started()
            await stop.wait()
            accepting.cancel_scope.cancel()
        await context.terminated.set()  # idle connections close; answers under way get `grace_s`
        connections.cancel_scope.deadline = trio.current_time() + limits.grace_s
    raise ended[0]


class _Connection(TCPServer):
    """hypercorn's connection, which ends when its client hangs up: hypercorn's own keeps its keep-alive
    timer running after the client has closed, holding the socket (and a place under
    `max_connections`) up to `keep_alive_s` longer."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


def _config(limits: Limits) -> HypercornConfig:
    config = HypercornConfig()
    config.keep_alive_timeout = limits.keep_alive_s
    # No timeout on each read: hypercorn's applies while a request waits for its answer too (a turn queued
    # behind others, a take's long poll), and cut those at the first pause longer than it. A head sent too
    # slowly is the keep-alive timer's (the connection is idle until a request is whole), a body the app's.
    config.read_timeout = None
    config.keep_alive_max_requests = 1 << 30
    config.include_server_header = False
    config.errorlog = log
    config.accesslog = None
    return config


async def _turn_away(stream: trio.SocketStream, most: int) -> None:
    """Answer a connection over the limit 503, without reading its request, and close it."""
    answer = HttpResponse.error(503, f"the endpoint holds {most} connections already: retry later",
                                "too_many_connections")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(answer.body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode()
    with trio.move_on_after(1):
        try:
            await stream.send_all(head + answer.body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await stream.aclose()


class _App:
    """ASGI: one request's body read within the limits, the handler's answer written."""

    def __init__(self, handler: Handler, fatal: tuple[type[Exception], ...], drain: Drain, limits: Limits,
                 end: Callable[[Exception], None]):
        self.handler, self.fatal, self.drain, self.limits, self.end = handler, fatal, drain, limits, end

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        self.drain.start()
        try:
            request = await self._read(scope, receive)
            if request is None:
                return  # the client went away
            answer = request if isinstance(request, HttpResponse) else await self._answer(request)
            await _write(send, answer)
        finally:
            self.drain.done()

    async def _answer(self, request: HttpRequest) -> HttpResponse | Streamed:
        try:
            return await self.handler(request)
        except self.fatal as exc:
            self.end(exc)
            return HttpResponse.error(503, f"{type(exc).__name__}: {exc}", "endpoint_ended")
        except Exception as exc:  # the handler's fault: the client hears of it, the endpoint stays up
            log.exception("[agents] %s %s failed", request.method, request.path)
            return HttpResponse.error(500, f"{type(exc).__name__}: {exc}", "internal_error")

    async def _read(self, scope: dict[str, Any], receive: Callable) -> HttpRequest | HttpResponse | None:
        """The request with its whole body, an answer that refuses it, or None (the client left)."""
        headers = {k.decode("latin-1").lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        most = self.limits.max_body
        too_big = HttpResponse.error(413, f"the request body is over {most} bytes", "invalid_request_error")
        if headers.get("content-length", "0").isdigit() and int(headers.get("content-length", "0")) > most:
            return too_big
        body = bytearray()
        with trio.move_on_after(self.limits.read_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                if len(body) > most:
                    return too_big
                if not message.get("more_body", False):
                    path = scope.get("raw_path") or scope["path"].encode()
                    query = scope.get("query_string", b"")
                    target = path.decode(errors="replace") + (f"?{query.decode(errors='replace')}" if query else "")
                    return HttpRequest(scope["method"], target, headers, bytes(body))
        return HttpResponse.error(408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s",
                                  "request_timeout")


async def _write(send: Callable, answer: HttpResponse | Streamed) -> None:
    headers = [(b"content-type", answer.content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in answer.headers]
    if isinstance(answer, HttpResponse):
        headers.append((b"content-length", str(len(answer.body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})
        return
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    chunks = answer.chunks
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:  # cut short too (the server ending under it): its generator's own cleanup runs now
        if hasattr(chunks, "aclose"):
            await chunks.aclose()
    await send({"type": "http.response.body", "body": b""})
