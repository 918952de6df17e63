"""An agent program for the tests: the `openai` package and httpx, no rlflow.

Each of `--sessions` loops takes an episode, plays `--turns` completions
(each prompt the last one, its completion and a word of its own), and ends
the episode with a reward of 1 if the last completion is longer than
`--long` characters, else 0. With `--die-once FILE`, the first copy to find
FILE missing creates it and kills itself after its first turn (an agent
that dies mid-episode). `--user` sends every turn to `{url}/v1` with the
episode's id as `user` instead of to the episode's base URL; `--stream`
streams each completion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import httpx
import openai


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--die-once", default="")
    parser.add_argument("--user", action="store_true")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    url, key = os.environ["RLFLOW_AGENTS_URL"], os.environ["OPENAI_API_KEY"]
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as hand_out:
        llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

        async def session() -> None:
            while True:
                try:
                    if not await play():
                        return  # the run is over
                except (openai.APIConnectionError, httpx.TransportError):  # the endpoint went away: ask again
                    await asyncio.sleep(0.1)
                except openai.APIError as exc:  # 410 (or an error event ending a stream): its episode is gone
                    if getattr(exc, "status_code", None) != 410 and exc.code != "episode_gone":
                        raise

        async def play() -> bool:
            taken = await hand_out.post("/rlflow/episodes", json={"wait_s": 5})
            if taken.status_code == 410:  # the run is over
                return False
            if taken.status_code == 200:
                episode = taken.json()
                model = llm if args.user else llm.with_options(base_url=episode["base_url"])
                named = {"user": episode["id"]} if args.user else {}
                prompt, said = episode["prompt"], ""
                for _ in range(args.turns):
                    if args.stream:
                        chunks = await model.completions.create(model="policy", prompt=prompt, max_tokens=16,
                                                                stream=True, **named)
                        said = "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])
                    else:
                        out = await model.completions.create(model="policy", prompt=prompt, max_tokens=16, **named)
                        said = out.choices[0].text
                    if args.die_once and not os.path.exists(args.die_once):
                        open(args.die_once, "w").close()
                        os.kill(os.getpid(), signal.SIGKILL)
                    prompt += said + " next:"
                reward = 1.0 if len(said) > args.long else 0.0
                await hand_out.post(f"/rlflow/episodes/{episode['id']}/end", json={"reward": reward})
            return True

        await asyncio.gather(*(session() for _ in range(args.sessions)))


if __name__ == "__main__":
    asyncio.run(main())
