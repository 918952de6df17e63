"""The agents' HTTP layer over a real loopback socket: answers, a handler's
error as 500 with the server going on, and a fatal error ending the server."""

from __future__ import annotations

import functools

import pytest
import trio

from rlflow.services.rollout import http


class Dead(RuntimeError):
    pass


async def handler(request: http.HttpRequest) -> http.HttpResponse:
    if request.path == "/boom":
        raise ValueError("a bug of the handler's")
    if request.path == "/dead":
        raise Dead("the engine is gone")
    return http.HttpResponse.of(200, {"path": request.path})


async def ask(port: int, path: str) -> bytes:
    """One request on a new connection; what came back before the server closed or answered."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
        return data


async def test_errors_are_answered_and_a_fatal_one_ends_the_server():
    sock = http.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with trio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(Dead, match="the engine is gone")):  # this test's nursery's
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(http.serve, fatal=(Dead,)), handler, sock)
                ok = await ask(port, "/ok")
                assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b'{"path": "/ok"}')
                boom = await ask(port, "/boom")
                assert boom.startswith(b"HTTP/1.1 500 ") and b"ValueError: a bug of the handler's" in boom
                assert (await ask(port, "/ok")).startswith(b"HTTP/1.1 200 ")  # still serving
                assert await ask(port, "/dead") == b""  # no answer: the server ends, raising it
                await trio.sleep_forever()  # until the nursery's serve raises
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)  # nothing listens any more
