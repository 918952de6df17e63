"""The agents' HTTP layer over real loopback sockets: answers, a handler's error as 500 with the server
going on, a fatal error answered 503 and ending the server, and clients that would hold the server:
idle, slow, oversized, malformed, too many. A whole run under such clients is in test_agents.py."""

from __future__ import annotations

import functools
import json

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
    return http.HttpResponse.of(200, {"path": request.path, "bytes": len(request.body)})


async def read_all(stream: trio.SocketStream) -> bytes:
    """What comes back until the server closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := await stream.receive_some():
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


async def ask(port: int, raw: bytes) -> bytes:
    """`raw` sent on a new connection; what came back before the server closed it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        return await read_all(stream)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


async def test_errors_are_answered_and_a_fatal_one_ends_the_server():
    sock = http.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with trio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(Dead, match="the engine is gone")):  # this test's nursery's
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(http.serve, fatal=(Dead,)), handler, sock)
                ok = await ask(port, get("/ok?x=1"))
                assert status(ok) == 200 and ok.endswith(b'{"path": "/ok?x=1", "bytes": 0}')
                boom = await ask(port, get("/boom"))
                assert status(boom) == 500 and b"ValueError: a bug of the handler's" in boom
                assert status(await ask(port, get("/ok"))) == 200  # still serving
                dead = await ask(port, get("/dead"))  # answered, then the server ends, raising it
                assert status(dead) == 503 and b"Dead: the engine is gone" in dead
                await trio.sleep_forever()  # until the nursery's serve raises
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)  # nothing listens any more


async def test_clients_that_would_hold_the_server_are_cut_off_while_the_others_are_served():
    limits = http.Limits(keep_alive_s=1.0, read_timeout_s=1.0, max_body=1 << 20)
    sock = http.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: dict[str, bytes] = {}

    async def idle() -> None:  # connects and says nothing: closed after keep_alive_s
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            seen["idle"] = await read_all(stream)

    async def slow_head() -> None:  # a byte of its request's head a tenth of a second, never done
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                for byte in b"GET /ok HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 10_000:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.1)
                seen["slow_head"] = b"still open after 1,000 s"
            except trio.BrokenResourceError:
                seen["slow_head"] = await read_all(stream)

    async def slow_body() -> None:  # the head at once, the body a byte a tenth of a second: 408
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"POST /slow HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n")
            async with trio.open_nursery() as trickle:
                @trickle.start_soon
                async def _() -> None:
                    try:
                        for _ in range(1000):
                            await stream.send_all(b"x")
                            await trio.sleep(0.1)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                seen["slow_body"] = await read_all(stream)
                trickle.cancel_scope.cancel()

    async def big() -> None:  # 10 MB by its Content-Length: 413 before the body is sent
        seen["big"] = await ask(port, b"POST /big HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % (10 << 20))

    async def chunked() -> None:  # chunks past the limit, no length said: 413 once they are past it
        piece = b"x" * (1 << 16)
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range((1 << 20 >> 16) + 1))
        seen["chunked"] = await ask(port, b"POST /big HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
                                    + chunks)  # all of it read by the server (no reset), no end chunk

    async def malformed() -> None:
        seen["malformed"] = await ask(port, b"HELLO THERE\r\n\r\n")
        seen["bad_header"] = await ask(port, b"GET / HTTP/1.1\r\nHost test\r\n\r\n")

    async def good() -> None:  # one client, kept alive, 20 requests while the others try their luck
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        answers = []
        async with stream:
            for i in range(20):
                body = json.dumps({"i": i}).encode()
                await stream.send_all(b"POST /good HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n%s"
                                      % (len(body), body))
                data = b""
                while not data.endswith(b"}"):
                    data += await stream.receive_some()
                answers.append(status(data))
                await trio.sleep(0.2)
        seen["good"] = bytes(answers)

    with trio.fail_after(60):
        async with trio.open_nursery() as server:
            await server.start(functools.partial(http.serve, limits=limits), handler, sock)
            async with trio.open_nursery() as clients:
                for client in (idle, slow_head, slow_body, big, chunked, malformed, good):
                    clients.start_soon(client)
            server.cancel_scope.cancel()
    assert seen["idle"] == b""
    assert status(seen["slow_head"]) in (0, 408), seen["slow_head"][:200]  # closed (hypercorn may say why)
    assert status(seen["slow_body"]) == 408 and b"did not arrive within 1 s" in seen["slow_body"]
    assert status(seen["big"]) == 413 and b"over 1048576 bytes" in seen["big"]
    assert status(seen["chunked"]) == 413
    assert status(seen["malformed"]) == 400 and status(seen["bad_header"]) == 400
    assert seen["good"] == bytes([200] * 20)


async def test_connections_over_the_limit_are_told_to_come_back():
    sock = http.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with trio.fail_after(60):
        async with trio.open_nursery() as server:
            await server.start(functools.partial(http.serve, limits=http.Limits(max_connections=8)), handler, sock)
            held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(8)]
            turned = await ask(port, get("/ok"))
            assert status(turned) == 503 and b"retry-after: 1" in turned and b"holds 8 connections" in turned
            await held.pop().aclose()
            while status(answer := await ask(port, get("/ok"))) == 503:  # until the server has seen it close
                await trio.sleep(0.05)
            assert status(answer) == 200
            for stream in held:
                await stream.aclose()
            server.cancel_scope.cancel()


async def test_an_answer_that_takes_longer_than_the_read_timeout_still_reaches_its_client(autojump_clock):
    """The read timeout is the request's (its body must come within it), not the answer's: a request whose
    handler takes three times `read_timeout_s` (a turn queued behind others, a take's long poll) is
    answered, on a connection the client then uses again. On trio's mock clock, which jumps whenever
    every task waits: no real time passes."""
    limits = http.Limits(keep_alive_s=5.0, read_timeout_s=0.5)

    async def slow(request: http.HttpRequest) -> http.HttpResponse:
        await trio.sleep_until(trio.current_time() + 3 * limits.read_timeout_s)
        return await handler(request)

    sock = http.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with trio.fail_after(30):
        async with trio.open_nursery() as server:
            await server.start(functools.partial(http.serve, limits=limits), slow, sock)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                for path in ("/first", "/second"):
                    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
                    answer = b""
                    while b"}" not in answer:
                        answer += await stream.receive_some()
                    assert status(answer) == 200 and path.encode() in answer
            server.cancel_scope.cancel()
