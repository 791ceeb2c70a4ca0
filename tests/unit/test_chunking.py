"""Chunking of big messages: split, reassembly in any order, and the memory limits."""

from __future__ import annotations

import random

import pytest

from shardserve.wire import chunking
from shardserve.wire.chunking import ChunkError, Reassembler, split


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def reassembler(**kw: object) -> tuple[Reassembler, ManualClock]:
    clock = ManualClock()
    limits: dict[str, object] = {"max_total_bytes": 1 << 20, **kw}
    return Reassembler(clock=clock, **limits), clock  # type: ignore[arg-type]


def test_a_body_that_fits_goes_whole_without_headers() -> None:
    data = body(100)
    assert split(data, 100) == [(data, {})]
    assert reassembler()[0].take({}, data) == data


def test_chunks_reassemble_in_any_order_and_duplicates_are_ignored() -> None:
    data = body(10_001)
    chunks = split(data, 1000)
    assert len(chunks) == 11 and all(len(c) <= 1000 for c, _ in chunks)
    shuffled = chunks + chunks[:3]  # redeliveries
    random.Random(1).shuffle(shuffled)
    rs, _ = reassembler()
    results = [rs.take(headers, part) for part, headers in shuffled]
    whole = [r for r in results if r is not None]
    assert whole == [data]
    assert len(rs) == 0


def test_interleaved_messages_are_kept_apart() -> None:
    a, b = body(3000, 1), body(2500, 2)
    rs, _ = reassembler()
    out = []
    for x, y in zip(split(a, 1000), split(b, 1000), strict=False):
        out += [rs.take(x[1], x[0]), rs.take(y[1], y[0])]
    out.append(rs.take(split(a, 1000)[-1][1], split(a, 1000)[-1][0]))
    assert out == [None, None, None, None, a, b, None]  # whole at its last chunk, once


def test_a_message_above_the_total_limit_is_refused() -> None:
    rs, _ = reassembler(max_total_bytes=5000)
    part, headers = split(body(6000), 1000)[0]
    with pytest.raises(ChunkError, match="exceeds 5000"):
        rs.take(headers, part)


def test_inconsistent_or_malformed_chunks_are_refused() -> None:
    rs, _ = reassembler()
    (p0, h0), (p1, h1), _ = split(body(3000), 1000)
    rs.take(h0, p0)
    with pytest.raises(ChunkError, match="disagrees"):
        rs.take({**h1, chunking.H_TOTAL: 5000}, p1)
    with pytest.raises(ChunkError, match="out of range"):
        rs.take({**h1, chunking.H_INDEX: 7}, p1)
    with pytest.raises(ChunkError, match="malformed"):
        rs.take({**h1, chunking.H_COUNT: "3"}, p1)
    with pytest.raises(ChunkError, match="exceed its declared size"):
        rs.take(h1, p1 + b"extra" * 300)


def test_only_so_many_messages_may_be_incomplete_at_once() -> None:
    rs, _ = reassembler(max_partial=2)
    firsts = [split(body(2000, seed), 1000) for seed in range(3)]
    for chunks in firsts:
        rs.take(chunks[0][1], chunks[0][0])
    assert len(rs) == 2 and rs.dropped == 1
    # the oldest was dropped: its last chunk no longer completes anything
    assert rs.take(firsts[0][1][1], firsts[0][1][0]) is None
    assert rs.take(firsts[2][1][1], firsts[2][1][0]) == body(2000, 2)


def test_incomplete_messages_expire() -> None:
    rs, clock = reassembler(expiry_s=10.0)
    (p0, h0), (p1, h1) = split(body(2000), 1000)
    rs.take(h0, p0)
    clock.now = 11.0
    other = split(body(200, 5), 100)[0]
    rs.take(other[1], other[0])  # any chunk's arrival sweeps the expired
    assert len(rs) == 1 and rs.dropped == 1
    assert rs.take(h1, p1) is None  # a fresh partial, never completed by the lost chunk


@pytest.mark.parametrize("limit", [7, 1000, 4096, 20_000])
def test_pieces_are_cut_exactly_as_their_joined_body(limit: int) -> None:
    rng = random.Random(limit)
    data = body(12_345, seed=limit)
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    from_pieces = list(chunking.split_pieces(pieces, limit))
    whole = split(data, limit)
    assert [part for part, _ in from_pieces] == [part for part, _ in whole]
    assert [strip_id(h) for _, h in from_pieces] == [strip_id(h) for _, h in whole]
    rs, _ = reassembler()
    assert [rs.take(h, part) for part, h in from_pieces][-1] == data


def test_pieces_that_fit_are_joined_into_one_body_without_headers() -> None:
    assert list(chunking.split_pieces([b"ab", b"", b"cd"], 4)) == [(b"abcd", {})]


def strip_id(headers: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in headers.items() if k != chunking.H_ID}
