"""The attacker of test_generation_attack.py, in a process of its own (as an attacker is):
sends rounds of maximum-size prompts and poison parameters to a gateway until told to
stop, then prints every answer's status as JSON.

    python flood_client.py BASE_URL MIN_ROUNDS
    # prints "flooding" as it starts; stop it with a line (or EOF) on stdin

Run in the measuring process, the flood's 9 MB of bodies a round were written by the loop
that timed the streams' tokens: its own stall, not the mesh's, was measured with them.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from typing import Any

import aiohttp

SERVABLE = "llama_tp2"
MAX_SIZE = "hello world " * 83333  # ~1 MB: within the wire's limit, far past the context


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SERVABLE, "prompt": "hi", "max_tokens": 4, **fields}


def chat(content: str) -> dict[str, Any]:
    return {"model": SERVABLE, "messages": [{"role": "user", "content": content}]}


# (route, JSON body or raw text, the statuses that are a right answer)
FLOOD: list[tuple[str, Any, set[int]]] = [
    *[("/v1/completions", completion(prompt=MAX_SIZE), {413})] * 4,
    *[("/v1/chat/completions", chat(MAX_SIZE), {413})] * 2,
    ("/v2/models/llama_tp2/generate", {"text_input": MAX_SIZE}, {413}),
    ("/v1/completions", completion(prompt="x" * 2_000_000), {413}),
    ("/v1/completions", completion(temperature=1e-310, top_p=0.9), {200}),
    ("/v1/completions", completion(temperature=5e-324, top_k=5), {200}),
    ("/v1/completions", completion(top_k=2**64), {400}),
    ("/v1/completions", completion(stop_token_ids=[2**64]), {400}),
    ("/v1/completions", completion(prompt="\ud800"), {400}),
    ("/v1/chat/completions", chat("\ud800"), {400}),
    ("/v1/completions", "[" * 100_000, {400}),
]
JSON = {"Content-Type": "application/json"}


def encoded() -> list[bytes]:
    return [
        body.encode() if isinstance(body, str) else json.dumps(body).encode()
        for _, body, _ in FLOOD
    ]


async def one_round(session: aiohttp.ClientSession, base: str, bodies: list[bytes]) -> list[int]:
    async def one(path: str, body: bytes) -> int:
        # A file-like body: aiohttp sends it in chunks (raw bytes past 1 MiB: one write).
        async with session.post(base + path, data=io.BytesIO(body), headers=JSON) as resp:
            await resp.read()
            return resp.status

    routes = [path for path, _, _ in FLOOD]
    return list(await asyncio.gather(*(one(p, b) for p, b in zip(routes, bodies, strict=True))))


async def flood(base: str, min_rounds: int) -> list[list[int]]:
    """Rounds until at least ``min_rounds`` are done and stdin says stop."""
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.readline)
    bodies, rounds = encoded(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        print("flooding", flush=True)
        while len(rounds) < min_rounds or not stop.done():
            rounds.append(await one_round(session, base, bodies))
    await stop
    return rounds


if __name__ == "__main__":
    print(json.dumps(asyncio.run(flood(sys.argv[1], int(sys.argv[2])))))
