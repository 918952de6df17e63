"""An env worker: a process that makes the run's environment and imports its
tools, then runs calls to them for the pool in its parent (`pool.py`).

It speaks over its stdin and stdout like a reward worker (a 4-byte length
and a msgpack message each way; see `rlflow.rewards.worker`). The parent
sends `Hello`; the worker makes the environment, imports the tools and
answers `Ready` with each tool's schema (or `Failed`, and exits). Then each
`Call` gets one `Done`, in whatever order they end: calls to async code run
at once on the worker's event loop, each cancelled at its `timeout_s`
(status timeout); sync code runs on the loop's thread, one call at a time,
and a call that overruns is the parent's to stop (it kills the worker).

Kept light: the standard library and msgspec, until `Hello` names what to import.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
from typing import Any

import msgspec

from rlflow.config.environment import EnvironmentSpec, ToolSpec
from rlflow.env.core import (
    BadReturn,
    Episode,
    check_observation,
    check_step,
    load_tool,
    make_environment,
    tool_schema,
    tool_text,
)
from rlflow.workers import describe, die_with_parent, frame, read_message, take_pipes, write_message


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """Parent -> worker, first: what to make, and where to import from."""

    environment: EnvironmentSpec
    tools: list[ToolSpec]
    sys_path: list[str]
    parent_pid: int


class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    """Worker -> parent: made and imported; each tool's schema (JSON text), in order."""

    tools: list[str]


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """Worker -> parent: the environment or a tool cannot be loaded; it exits."""

    message: str


class Call(msgspec.Struct, tag="call", array_like=True, frozen=True):
    """Parent -> worker: one call. `kind`: reset, step, tool or reference (see `Worker.run`)."""

    id: int
    kind: str
    args: dict[str, Any]
    timeout_s: float


class Done(msgspec.Struct, tag="done", array_like=True, frozen=True):
    """Worker -> parent: how call `id` ended: `status` ok (with `value`), timeout or error (with `message`)."""

    id: int
    status: str
    value: Any = None
    message: str = ""


ToWorker = Hello | Call
FromWorker = Ready | Failed | Done


def main() -> None:
    """The worker's whole life (run as `python -c`, by `pool.py`)."""
    incoming, outgoing = take_pipes()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    hello = decoder.decode(read_message(incoming) or b"")
    assert isinstance(hello, Hello)
    die_with_parent(hello.parent_pid)
    sys.path[:] = hello.sys_path
    loop = asyncio.new_event_loop()
    try:
        worker = Worker(hello, loop)
        ready = Ready([msgspec.json.encode(schema).decode() for schema in worker.schemas])
    except (Exception, SystemExit) as error:
        write_message(outgoing, frame(Failed(describe(error))))
        os._exit(1)
    write_message(outgoing, frame(ready))

    def reply(done: Done) -> None:
        try:
            data = frame(done)
        except (TypeError, ValueError, OverflowError) as error:  # e.g. a state that is not plain data
            data = frame(Done(done.id, "error", message=f"returned what cannot be sent back: {describe(error)}"))
        write_message(outgoing, data)

    def start(call: Call) -> None:
        loop.create_task(worker.run(call, reply))

    def read() -> None:
        while (data := read_message(incoming)) is not None:
            call = decoder.decode(data)
            assert isinstance(call, Call)  # after the hello, the parent sends only calls
            loop.call_soon_threadsafe(start, call)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, name="calls", daemon=True).start()
    loop.run_forever()
    os._exit(0)


class Worker:
    """The environment and tools of one worker process, and how a call runs."""

    def __init__(self, hello: Hello, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.env = make_environment(hello.environment)
        self.tools = {spec.name: (spec, load_tool(spec)) for spec in hello.tools}
        self.schemas = [tool_schema(fn, spec) for spec, fn in self.tools.values()]

    async def run(self, call: Call, reply) -> None:
        """Run `call` and `reply` its `Done`."""
        try:
            value = await asyncio.wait_for(self._call(call.kind, call.args), call.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            done = Done(call.id, "timeout", message=f"took longer than its timeout of {call.timeout_s:g} s")
        except BadReturn as error:
            done = Done(call.id, "error", message=str(error))
        except (Exception, SystemExit) as error:
            done = Done(call.id, "error", message=describe(error))
        else:
            done = Done(call.id, "ok", value)
        reply(done)

    async def _call(self, kind: str, args: dict[str, Any]) -> Any:
        match kind:
            case "reset":
                text, messages = check_observation(await _resolve(self.env.reset(args["row"])), "reset")
                return {"text": text, "messages": messages}
            case "reference":
                turns = getattr(self.env, "reference_turns", None)
                return [] if turns is None else [str(t) for t in await _resolve(turns(args["row"]))]
            case "step":
                episode = Episode(**args["episode"])
                result = await _resolve(self.env.step(episode, args["turn"]))
                text, messages, reward, done = check_step(tuple(result) if isinstance(result, tuple) else result)
                return {"text": text, "messages": messages, "reward": reward, "done": done, "state": episode.state}
            case "tool":
                spec, fn = self.tools[args["name"]]
                return tool_text(await _resolve(fn(**args["arguments"], **spec.kwargs)))
        raise ValueError(f"unknown call {kind!r}")


async def _resolve(value: Any) -> Any:
    """`value`, or what it resolves to if it is awaitable."""
    return await value if inspect.isawaitable(value) else value
