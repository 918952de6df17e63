"""A small HTTP/1.1 server on trio, for the agents' endpoint (`agents`): h11
parses and writes the protocol, this module reads and writes sockets.

A handler gets one `HttpRequest` (its whole body read, at most `MAX_BODY`
bytes) and returns an `HttpResponse`, or a `Streamed` one whose body is
written in chunks as they come (server-sent events). Connections are kept
alive between requests, as HTTP clients (httpx, under the `openai` package)
expect. A handler that raises answers 500, unless what it raised is one of
`serve`'s `fatal` exceptions: that ends the server (the replica's engine
died: no request can be served any more); a request h11 cannot parse, 400.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

log = logging.getLogger("rlflow.agents")

#: The largest request body read (a long conversation with its tools is well under it).
MAX_BODY = 16 << 20


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

    @classmethod
    def of(cls, status: int, value: Any) -> HttpResponse:
        return cls(status, json.dumps(value).encode())


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
                drain: Drain | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `handler` on the listening socket `sock` (see `bind`) until cancelled, or until the handler
    raises one of `fatal`, which `serve` raises then; `drain` counts the requests under way."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    try:
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(lambda stream: _connection(stream, handler, fatal, drain or Drain()), [listener],
                                       handler_nursery=nursery)
    except BaseExceptionGroup as group:
        ended = group.subgroup(fatal) if fatal else None
        if ended is None:
            raise
        while isinstance(ended, BaseExceptionGroup):  # the first, as it was raised
            ended = ended.exceptions[0]
        raise ended from None


async def _connection(stream: trio.SocketStream, handler: Handler, fatal: tuple[type[Exception], ...],
                      drain: Drain) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 << 10)
    try:
        while True:
            request = await _read(stream, conn)
            if request is None:
                return
            drain.start()
            try:
                try:
                    answer = await handler(request)
                except fatal:
                    raise
                except Exception as exc:  # the handler's fault: the client hears of it, the endpoint stays up
                    log.exception("[agents] %s %s failed", request.method, request.path)
                    answer = HttpResponse.of(500, {"error": {"message": f"{type(exc).__name__}: {exc}",
                                                             "type": "internal_error"}})
                await _write(stream, conn, answer)
            finally:
                drain.done()
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError, h11.LocalProtocolError):
        return  # the client went away, or spoke something else
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await stream.aclose()


async def _read(stream: trio.SocketStream, conn: h11.Connection) -> HttpRequest | None:
    """The next request on the connection (None: the client closed it)."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(1 << 16)
            conn.receive_data(data)
            if not data and head is None and conn.their_state is h11.IDLE:
                return None
            continue
        if isinstance(event, h11.ConnectionClosed):
            return None
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY:
                await _write(stream, conn, HttpResponse.of(413, {"error": {
                    "message": f"the request body is over {MAX_BODY} bytes", "type": "invalid_request_error"}}))
                return None
        elif isinstance(event, h11.EndOfMessage):
            headers = {k.decode().lower(): v.decode(errors="replace") for k, v in head.headers}
            return HttpRequest(head.method.decode(), head.target.decode(errors="replace"), headers, bytes(body))


async def _write(stream: trio.SocketStream, conn: h11.Connection, answer: HttpResponse | Streamed) -> None:
    if isinstance(answer, HttpResponse):
        headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
        await stream.send_all(conn.send(h11.Response(status_code=answer.status, headers=headers)))
        if answer.body:
            await stream.send_all(conn.send(h11.Data(data=answer.body)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return
    headers = [("content-type", answer.content_type), *answer.headers]
    await stream.send_all(conn.send(h11.Response(status_code=answer.status, headers=headers)))
    async for chunk in answer.chunks:
        await stream.send_all(conn.send(h11.Data(data=chunk)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
