"""An agent written against the OpenAI API alone, trained by rlflow.

It plays the default task (addition written out column by column) with a
tool of its own: after the model's first answer, the agent checks it column
by column with `check_columns` and, if it is wrong, gives the model the
problem again with the columns written right up to the first wrong one, for
a second try. A right first answer earns 1, a right second one 0.5.

Nothing here imports rlflow: the model is reached with the `openai` package,
episodes are taken and ended over HTTP (httpx, which `openai` uses). rlflow
starts copies of it (``[agents] command`` in examples/openai_agent.toml) with
RLFLOW_AGENTS_URL and OPENAI_API_KEY set; started by hand, point it at a run:

    python examples/openai_agent.py --url http://127.0.0.1:PORT --key KEY

(both are in the run directory's agents.json). Each copy plays `--sessions`
episodes at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import httpx
import openai


def columns(a: int, b: int) -> list[str]:
    """The worked columns of a + b, as the model is to write them (``7+8=15``, ...)."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    out, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        out.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
        carry = total // 10
    return out


def answer(text: str) -> int | None:
    """The number after the last '#' of a model's answer."""
    _, sep, tail = text.rpartition("#")
    return int(tail.strip()) if sep and tail.strip().isdigit() and len(tail.strip()) <= 40 else None


def check_columns(a: int, b: int, said: str) -> str:
    """The agent's tool: the problem again, and its columns written right up to the first one
    `said` got wrong (the model goes on from there)."""
    right, given = columns(a, b), said.split(",")
    wrong = next((i for i, c in enumerate(right) if i >= len(given) or given[i] != c), len(right) - 1)
    return f"{a}+{b}=" + ",".join(right[: wrong + 1]) + ","


async def play(hand_out: httpx.AsyncClient, llm: openai.AsyncOpenAI, max_tokens: int) -> bool:
    """Take one episode, play it, end it with its reward; False when none came."""
    taken = await hand_out.post("/rlflow/episodes", json={"wait_s": 20})
    if taken.status_code == 204:
        return False
    taken.raise_for_status()
    episode = taken.json()
    model = llm.with_options(base_url=episode["base_url"])  # the episode's own base URL
    a, b = episode["row"]["a"], episode["row"]["b"]
    prompt, reward = episode["prompt"], 0.0
    try:
        first = (await model.completions.create(model="policy", prompt=prompt, max_tokens=max_tokens)).choices[0].text
        if answer(first) == a + b:
            reward = 1.0
        else:
            hint = check_columns(a, b, first)
            second = (await model.completions.create(model="policy", prompt=prompt + first + hint,
                                                     max_tokens=max_tokens)).choices[0].text
            reward = 0.5 if answer(hint + second) == a + b else 0.0
    except openai.BadRequestError:
        pass  # the episode ran out of turns or tokens: it ends with what it earned
    await hand_out.post(f"/rlflow/episodes/{episode['id']}/end", json={"reward": reward})
    return True


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("RLFLOW_AGENTS_URL", ""), help="the run's endpoint")
    parser.add_argument("--key", default=os.environ.get("OPENAI_API_KEY", ""), help="the run's key")
    parser.add_argument("--sessions", type=int, default=int(os.environ.get("AGENT_SESSIONS", "32")),
                        help="episodes played at once")
    parser.add_argument("--max-tokens", type=int, default=100, help="tokens of one model turn at most")
    args = parser.parse_args()
    if not args.url or not args.key:
        parser.error("no endpoint: give --url and --key (agents.json of the run has both)")
    headers = {"Authorization": f"Bearer {args.key}"}
    limits = httpx.Limits(max_connections=2 * args.sessions, max_keepalive_connections=2 * args.sessions)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=60, limits=limits) as hand_out:
        llm = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.key, max_retries=0, timeout=600,
                                 http_client=openai.DefaultAsyncHttpxClient(limits=limits))

        async def session() -> None:
            while True:
                try:
                    await play(hand_out, llm, args.max_tokens)
                except (httpx.HTTPError, openai.APIError) as exc:  # the run restarting a replica, or ending
                    print(f"agent: {type(exc).__name__}: {exc}", flush=True)
                    await asyncio.sleep(1)

        await asyncio.gather(*(session() for _ in range(args.sessions)))


if __name__ == "__main__":
    asyncio.run(main())
