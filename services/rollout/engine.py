"""What the rollout service needs of an engine (`RolloutEngine`); the service
chooses one from the config (`service.make_engine`).

An engine gets an `EngineContext` (config, rank, clock, counters), never the
service. It generates the groups it is given with continuous batching and
hands each finished group, with one `Response` per sample, to the service
through its `finished` channel, together with any others that finished at
the same time; or, for an episode's turns (`generate`), one response at a
time to whoever awaits it. Weights reach it between two of its steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

from rlflow.protocol import Adapter, EngineLoad, ParamSpec, PromptGroup, Response, WeightTransfer

class EngineDead(RuntimeError):
    """The engine is gone (vLLM's engine core died): the replica can serve no request more, and ends, to
    be restarted. Raised out of whatever waited on the engine, an agent's turn too."""


#: What an engine hands the service: a group and one response per sample.
Finished = tuple[PromptGroup, list[Response]]


class VersionWait:
    """Turns that may not start before the engine holds a given policy version:
    any number wait at once, and each goes on at the first change of version
    that reaches its own (one event shared by all waiters, replaced once set,
    so that no waiter is left on an event that nobody will set)."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    def changed(self) -> None:
        """The engine's version changed: every waiter looks again."""
        self._changed.set()
        self._changed = trio.Event()

    async def reach(self, version: int, held: Callable[[], int]) -> None:
        """Return once `held()` (the engine's version) is at least `version`."""
        while held() < version:
            await self._changed.wait()


class RolloutEngine(Protocol):
    """A generator of responses that takes new weights while it runs."""

    version: int
    """The policy version of the weights it generates with."""
    finished: trio.MemoryReceiveChannel[list[Finished]]
    """Each group, the moment its last sample is done (with the others done by then)."""
    eval_concurrency: int
    """Held-out prompts to have in flight at once."""
    checksum: str
    """The checksum of the weights it received last and serves (SPEC.md, *Checksums*; empty: none)."""

    async def start(self) -> None:
        """Load the model (blocking work goes to a thread)."""

    def hello_fields(self) -> dict[str, Any]:
        """What the controller should know (`Hello`'s ``slots``: sequences decoded at once; ``model``)."""

    def load(self) -> EngineLoad:
        """The engine's load now (for the heartbeats)."""

    async def set_version(self, version: int) -> None:
        """Label the weights held now (above 0 when the run resumes)."""

    async def join_weights(self, transfer: WeightTransfer | None, layout: list[ParamSpec],
                           adapter: Adapter | None = None) -> None:
        """Get ready to receive weights as the controller's welcome says (with
        `adapter`: serve the base with that LoRA adapter, whose tensors the
        updates carry)."""

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """The engine's loop, until cancelled."""

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        """Generate `group` (not before its `min_version` is held)."""

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, min_version: int = 0,
                       temperature: float | None = None, on_tokens: Callable[[list[int]], None] | None = None
                       ) -> Response:
        """One response to `prompt_ids` (an episode's turn: its whole token sequence so far), of at
        most `max_tokens` tokens, batched with the engine's other work; not started on weights older
        than `min_version`; at the configured temperature unless `temperature` is given. `on_tokens`
        is called (in trio) with the tokens so far as the engine makes them, where it makes them one
        step at a time (the simulated engine makes a turn at once: it never calls it)."""

    async def update_weights(self, version: int, transfer: WeightTransfer | None) -> int:
        """Receive `version` (joining `transfer` first, if given) and apply it
        between two steps; the version now held."""

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        """One answer to a held-out prompt (not a training sample)."""

    def queues(self) -> dict[str, int]:
        """Requests waiting and running now."""

    async def close(self) -> None:
        """Release the engine."""
