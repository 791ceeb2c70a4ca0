"""The streaming client of the generation benchmark: OpenAI ``/v1/completions`` with
``stream=true`` over aiohttp, timing every server-sent chunk as it arrives (as vLLM's
``benchmark_serving`` does), with random token-id prompts of a fixed length.

A load (``GenLoad``) sends warm-up requests first (not counted), then its requests at the
Poisson send times of ``gen_metrics.poisson_offsets`` (rate inf: all at once), never more
than ``max_concurrency`` in flight. The mesh's gateway and the transformers peer
(``gen_peer``) speak the same protocol, so both are measured by this one client.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from benchmarks.gen_metrics import Trace, poisson_offsets

# Prompt ids are drawn from here: above the special and byte-level tokens of the benchmark
# tokenizer (its filler words), below every benchmark model's vocabulary.
PROMPT_ID_RANGE = (1000, 31000)


@dataclass(frozen=True)
class GenLoad:
    """One measured load: fixed prompt and output lengths, arrivals, concurrency cap."""

    input_len: int
    output_len: int
    requests: int
    max_concurrency: int
    rate: float = math.inf  # requests per second (Poisson); inf: all at once
    warmup: int = 2
    seed: int = 0

    @property
    def label(self) -> str:
        arrivals = "" if math.isinf(self.rate) else f".rate{self.rate:g}"
        return f"in{self.input_len}-out{self.output_len}.c{self.max_concurrency}{arrivals}"


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids (vLLM's random dataset)."""
    rng = np.random.default_rng(seed)
    low, high = PROMPT_ID_RANGE
    return [[int(v) for v in rng.integers(low, high, size=length)] for _ in range(count)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens (EOS ignored), usage in the last chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], prompt_tokens: int
) -> Trace:
    """Send one streamed completion and time its chunks."""
    trace = Trace(sent=time.perf_counter(), prompt_tokens=prompt_tokens)
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                trace.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return trace
            async for line in response.content:
                _take_line(trace, line, time.perf_counter())
    except (TimeoutError, aiohttp.ClientError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace
    trace.done = time.perf_counter()
    if not trace.output_tokens:
        trace.output_tokens = len(trace.chunk_times)
    return trace


def _take_line(trace: Trace, line: bytes, now: float) -> None:
    text = line.strip()
    if not text.startswith(b"data:"):
        return
    payload = text[5:].strip()
    if payload == b"[DONE]":
        return
    chunk = json.loads(payload)
    if "error" in chunk:
        trace.error = json.dumps(chunk["error"])[:300]
        return
    choices = chunk.get("choices") or []
    if choices and choices[0].get("text"):
        trace.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage:
        trace.output_tokens = int(usage.get("completion_tokens", 0))


async def run_gen_load(
    base_url: str, model: str, load: GenLoad, *, fresh_connections: bool = False
) -> list[Trace]:
    """Warm-up requests one after another, then the measured ones; their traces.
    ``fresh_connections``: one connection per request (as vLLM's client opens a session per
    request), for a server that closes idle keep-alive connections under the client."""
    url = f"{base_url}/v1/completions"
    prompts = random_prompts(load.warmup + load.requests, load.input_len, load.seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(
        limit=max(load.max_concurrency, 1), force_close=fresh_connections
    )
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for prompt in prompts[: load.warmup]:
            await stream_one(session, url, completion_body(model, prompt, load.output_len), 0)
        measured = prompts[load.warmup :]
        return await _arrivals(session, url, model, load, measured)


async def _arrivals(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    load: GenLoad,
    prompts: Sequence[list[int]],
) -> list[Trace]:
    offsets = poisson_offsets(load.rate, len(prompts), load.seed)
    limit = asyncio.Semaphore(load.max_concurrency)
    start = time.perf_counter()

    async def one(prompt: list[int], offset: float) -> Trace:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with limit:
            body = completion_body(model, prompt, load.output_len)
            return await stream_one(session, url, body, len(prompt))

    return list(await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True))))
