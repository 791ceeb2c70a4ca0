"""A generation stream's pace (streams.TokenPace) on a manual clock: no first chunk within
``first_s`` of the request, or no chunk within ``between_s`` of the previous one, ends the
stream with deadline_exceeded naming the setting; chunks that keep coming never do, however
long the whole answer takes (the request's own deadline still bounds it)."""

from __future__ import annotations

import pytest

from shardserve.errors import DeadlineError
from shardserve.wire.protocol import GenerateChunk
from shardserve_gateway.generation.streams import ChunkStream, TokenPace


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chunk(seq: int) -> GenerateChunk:
    return GenerateChunk(id="r", seq=seq, token_ids=(seq,), text="t")


def stream(clock: Clock, deadline: float = 10_000.0) -> ChunkStream:
    return ChunkStream(deadline, wall_clock=clock, pace=TokenPace(first_s=5.0, between_s=2.0))


async def test_no_first_token_in_time_ends_the_stream_naming_the_setting() -> None:
    clock = Clock()
    chunks = stream(clock)
    clock.now += 5.0
    with pytest.raises(DeadlineError, match=r"no first token within 5 s .*--first-token-timeout"):
        await anext(chunks)


async def test_a_gap_between_tokens_ends_the_stream_naming_the_setting() -> None:
    clock = Clock()
    chunks = stream(clock)
    clock.now += 4.9  # a slow first token is within its own limit
    chunks.deliver(chunk(0))
    assert (await anext(chunks)).seq == 0
    clock.now += 2.0
    with pytest.raises(DeadlineError, match=r"no token for 2 s after chunk 0 .*--token-timeout"):
        await anext(chunks)


async def test_a_steady_stream_outlasts_any_pace_limit_but_not_its_deadline() -> None:
    clock = Clock()
    chunks = stream(clock, deadline=clock.now + 100.0)
    for seq in range(60):  # 60 tokens 1.5 s apart: 90 s in all, 18 times first_s
        clock.now += 1.5
        chunks.deliver(chunk(seq))
        assert (await anext(chunks)).seq == seq
    clock.now += 10.5  # past the request's own deadline (X-Request-Timeout)
    chunks.deliver(chunk(60))
    assert (await anext(chunks)).seq == 60  # what arrived is delivered
    with pytest.raises(DeadlineError, match="deadline exceeded while generating"):
        await anext(chunks)
