"""The loop of an agent program that plays rlflow's episodes, for the examples beside it (httpx alone:
nothing of rlflow, so that it runs on any interpreter, verifiers' own too).

`play_episodes` runs `sessions` loops at once. Each takes an episode from the endpoint at `url`
(`POST /rlflow/episodes`, long-polled), plays it with `play(episode)`, which returns its reward, and
ends it with that reward; until the run is over (410). With `record`, each ended episode's id and
reward are appended to that file, a line each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx


async def play_episodes(url: str, key: str, sessions: int, play: Callable[[dict[str, Any]], Awaitable[float]],
                        record: str = "") -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as hand_out:

        async def session() -> None:
            while True:
                taken = await hand_out.post("/rlflow/episodes", json={"wait_s": 20})
                if taken.status_code == 204:
                    continue
                if taken.status_code == 410:
                    return  # the run is over
                taken.raise_for_status()
                episode = taken.json()
                reward = await play(episode)
                ended = await hand_out.post(f"/rlflow/episodes/{episode['id']}/end", json={"reward": reward})
                if record and ended.status_code == 200:
                    with open(record, "a") as out:
                        out.write(f"{episode['id']} {reward}\n")

        await asyncio.gather(*(session() for _ in range(sessions)))
