"""An ordinary OpenAI-client agent that trains an ``rlcore-online`` service by playing Countdown against it.

The agent knows nothing of rlcore but its HTTP endpoints: per problem it opens ``group`` sessions (same task_id, so
the service normalises their rewards as a GRPO group), asks the model through the official ``openai`` client
(base_url = the service's /v1, api_key = the session key), scores the answer itself, posts the reward and ends the
session. ``--turns 2`` retries a wrong answer once in the same conversation (a two-turn session).

Run (after ``rlcore-online serve`` and ``rlcore-online keys create --name agent``):
    python experiments/online_agent.py --url http://127.0.0.1:8300 --api-key sk-agent-... --minutes 3
It prints one JSON line per finished window of sessions: {"t": s, "sessions": n, "reward": mean}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp
from openai import AsyncOpenAI

from rlcore.data import countdown
from rlcore.rollout.rewards import countdown as countdown_reward


async def episode(http: aiohttp.ClientSession, oai: AsyncOpenAI, args: argparse.Namespace, task: str,
                  problem: countdown.Problem) -> float:
    async with http.post("/rl/start_session", json={"task_id": task}) as r:
        r.raise_for_status()
        session_key = (await r.json())["api_key"]
    headers = {"Authorization": f"Bearer {session_key}"}
    prompt = countdown.format_prompt(problem.numbers, problem.target)
    messages = [{"role": "user", "content": prompt}]
    reward = 0.0
    client = oai.with_options(api_key=session_key)  # one connection pool, this session's key
    for _ in range(args.turns):
        resp = await client.chat.completions.create(model="rlcore-policy", messages=messages,
                                                    max_tokens=args.max_tokens, temperature=1.0)
        text = resp.choices[0].message.content or ""
        reward = countdown_reward.reward(text, problem.numbers, problem.target)
        if reward > 0:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": prompt}]
    for path, body in (("/rl/set_reward", {"reward": reward}), ("/rl/end_session", {})):
        async with http.post(path, json=body, headers=headers) as r:
            r.raise_for_status()
    return reward


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    done: list[float] = []
    sem = asyncio.Semaphore(args.concurrency)
    window: list[float] = []

    async with aiohttp.ClientSession(base_url=args.url, timeout=aiohttp.ClientTimeout(total=120),
                                     headers={"Authorization": f"Bearer {args.api_key}"}) as http, \
            AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0) as oai:

        async def one(task: str, problem: countdown.Problem) -> None:
            async with sem:
                if time.monotonic() >= deadline or (args.sessions and len(done) >= args.sessions):
                    return
                r = await episode(http, oai, args, task, problem)
                done.append(r)
                window.append(r)
                if len(window) >= args.window:
                    print(json.dumps({"t": round(time.monotonic() - t0, 1), "sessions": len(done),
                                      "reward": sum(window) / len(window)}), flush=True)
                    window.clear()

        k = 0
        while time.monotonic() < deadline and not (args.sessions and len(done) >= args.sessions):
            tasks = []
            for _ in range(max(1, args.concurrency // args.group)):
                p = countdown.random_problem(rng)
                task = f"p{k}:{countdown.format_prompt(p.numbers, p.target)}"
                k += 1
                tasks += [one(task, p) for _ in range(args.group)]
            await asyncio.gather(*tasks)
    print(json.dumps({"t": round(time.monotonic() - t0, 1), "sessions": len(done), "final": True,
                      "reward_all": sum(done) / max(1, len(done))}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8300")
    ap.add_argument("--api-key", required=True, help="an agent key from `rlcore-online keys create`")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--sessions", type=int, default=0, help="stop after this many sessions (0: --minutes decides)")
    ap.add_argument("--group", type=int, default=8, help="sessions per problem (one task_id)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--turns", type=int, default=1, help="attempts per session (2: retry a wrong answer once)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--window", type=int, default=128, help="sessions per printed reward line")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.group < 1 or args.concurrency < 1 or args.turns < 1 or args.max_tokens < 1 or args.window < 1:
        ap.error("--group, --concurrency, --turns, --max-tokens and --window must be >= 1")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
