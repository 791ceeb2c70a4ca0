"""Chunking of big messages: split, reassembly in any order, and the memory limits."""

from __future__ import annotations

import random

import pytest

from shardserve.process.settings import BrokerSettings
from shardserve.wire import chunking
from shardserve.wire.chunking import ChunkError, Fragment, Reassembler, split


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def reassembler(**kw: object) -> tuple[Reassembler[str], ManualClock]:
    """A reassembler whose origins are labels, on a manual clock."""
    clock = ManualClock()
    limits: dict[str, object] = {"max_total_bytes": 1 << 20, **kw}
    return Reassembler[str](clock=clock, **limits), clock  # type: ignore[arg-type]


def test_a_body_that_fits_goes_whole_without_headers() -> None:
    data = body(100)
    assert split(data, 100) == [(data, {})]
    assert reassembler()[0].take({}, data, "q") == data


def test_chunks_reassemble_in_any_order_and_redeliveries_are_ignored() -> None:
    data = body(10_001)
    chunks = split(data, 1000)
    assert len(chunks) == 11 and all(len(c) <= 1000 for c, _ in chunks)
    rng = random.Random(1)
    deliveries = [(c, False) for c in rng.sample(chunks, len(chunks))]
    for chunk in chunks[:3]:  # each redelivered some time after its first delivery
        first = deliveries.index((chunk, False))
        deliveries.insert(rng.randint(first + 1, len(deliveries)), (chunk, True))
    rs, _ = reassembler()
    results = [rs.take(h, part, "q", redelivered=again) for (part, h), again in deliveries]
    whole = [r for r in results if r is not None]
    assert whole == [data]
    assert len(rs) == 0 and rs.sweep() == [] and rs.dropped == 0


def test_interleaved_messages_are_kept_apart() -> None:
    a, b = body(3000, 1), body(2500, 2)
    rs, _ = reassembler()
    out = []
    for x, y in zip(split(a, 1000), split(b, 1000), strict=False):
        out += [rs.take(x[1], x[0], "q"), rs.take(y[1], y[0], "q")]
    last = split(a, 1000)[-1]
    out.append(rs.take(last[1], last[0], "q", redelivered=True))
    assert out == [None, None, None, None, a, b, None]  # whole at its last chunk, once


def test_a_message_above_the_total_limit_is_refused() -> None:
    rs, _ = reassembler(max_total_bytes=5000)
    part, headers = split(body(6000), 1000)[0]
    with pytest.raises(ChunkError, match="exceeds 5000"):
        rs.take(headers, part, "q")
    assert rs.sweep() == [] and rs.dropped == 0  # nothing was held: only this chunk is bad


def test_malformed_chunks_are_refused_and_leave_the_held_message_alone() -> None:
    rs, _ = reassembler()
    (p0, h0), (p1, h1), (p2, h2) = split(body(3000), 1000)
    rs.take(h0, p0, "q")
    with pytest.raises(ChunkError, match="out of range"):
        rs.take({**h1, chunking.H_INDEX: 7}, p1, "q")
    with pytest.raises(ChunkError, match="malformed"):
        rs.take({**h1, chunking.H_COUNT: "3"}, p1, "q")
    assert rs.sweep() == [] and len(rs) == 1
    assert rs.take(h1, p1, "q") is None and rs.take(h2, p2, "q") == body(3000)


# How the last of three chunks (1000 bytes each) can contradict the two held before it.
CONTRADICTIONS = {
    "disagrees on its size": lambda h, p: ({**h, chunking.H_TOTAL: 5000}, p),
    "arrived twice": lambda h, p: ({**h, chunking.H_INDEX: 0}, p),
    "exceed its declared size": lambda h, p: (h, p + b"extra"),
    "has 2000 of 3000 bytes": lambda h, p: (h, b""),
}


@pytest.mark.parametrize("problem", CONTRADICTIONS)
def test_a_contradicting_chunk_gives_its_message_up_with_the_chunks_held(problem: str) -> None:
    """The chunk at hand is refused (its consumer dead-letters it); the chunks held for
    the same message were acked already, so ``sweep`` hands them back to dead-letter."""
    rs, _ = reassembler()
    (p0, h0), (p1, h1), (p2, h2) = split(body(3000), 1000)
    assert rs.take(h0, p0, "held-0") is None and rs.take(h1, p1, "held-1") is None
    bad_headers, bad_part = CONTRADICTIONS[problem](h2, p2)
    with pytest.raises(ChunkError, match=problem):
        rs.take(bad_headers, bad_part, "bad")
    [abandoned] = rs.sweep()
    assert problem in abandoned.reason and h0[chunking.H_ID] in abandoned.reason
    assert abandoned.fragments == (Fragment(p0, h0, "held-0"), Fragment(p1, h1, "held-1"))
    assert len(rs) == 0 and rs.dropped == 1 and rs.sweep() == []


def test_a_whole_message_tells_where_the_chunks_held_before_its_last_came_from() -> None:
    """So that all of them can be dead-lettered when the body proves undecodable."""
    data = body(2500)
    (p0, h0), (p1, h1), (p2, h2) = split(data, 1000)
    rs, _ = reassembler()
    assert rs.take_whole(h2, p2, "d2") is None and rs.take_whole(h0, p0, "d0") is None
    whole = rs.take_whole(h1, p1, "d1")
    assert whole is not None and whole.body == data and whole.last == 1
    assert list(whole.held()) == [Fragment(p0, h0, "d0"), Fragment(p2, h2, "d2")]
    unchunked = rs.take_whole({}, b"small", "d")
    assert unchunked is not None and unchunked.body == b"small" and list(unchunked.held()) == []


def test_late_chunks_of_a_finished_message_are_refused_unless_redelivered() -> None:
    rs, _ = reassembler()
    (p0, h0), (p1, h1) = split(body(2000), 1000)
    rs.take(h0, p0, "q")
    assert rs.take(h1, p1, "q") == body(2000)
    assert rs.take(h1, p1, "q", redelivered=True) is None
    with pytest.raises(ChunkError, match="already complete or given up"):
        rs.take(h0, p0, "q")
    assert rs.sweep() == [] and len(rs) == 0


def test_only_so_many_messages_may_be_incomplete_at_once() -> None:
    rs, _ = reassembler(max_partial=2)
    firsts = [split(body(2000, seed), 1000) for seed in range(3)]
    for seed, chunks in enumerate(firsts):
        rs.take(chunks[0][1], chunks[0][0], f"first-{seed}")
    assert len(rs) == 2 and rs.dropped == 1
    [evicted] = rs.sweep()
    assert "evicted" in evicted.reason and [f.origin for f in evicted.fragments] == ["first-0"]
    # the oldest was given up: its last chunk is bad input now (or ignored, if redelivered)
    with pytest.raises(ChunkError, match="given up"):
        rs.take(firsts[0][1][1], firsts[0][1][0], "q")
    assert rs.take(firsts[0][1][1], firsts[0][1][0], "q", redelivered=True) is None
    assert rs.take(firsts[2][1][1], firsts[2][1][0], "q") == body(2000, 2)


def test_incomplete_messages_expire_on_a_sweep_with_no_other_chunk() -> None:
    rs, clock = reassembler(expiry_s=10.0)
    (p0, h0), (p1, h1) = split(body(2000), 1000)
    rs.take(h0, p0, "first")
    clock.now = 9.9
    assert rs.sweep() == [] and len(rs) == 1
    clock.now = 10.0
    [expired] = rs.sweep()
    assert expired.reason.endswith("incomplete after 10 s (1 of 2 chunks)")
    assert expired.fragments == (Fragment(p0, h0, "first"),)
    assert len(rs) == 0 and rs.dropped == 1 and rs.sweep() == []
    with pytest.raises(ChunkError, match="given up"):
        rs.take(h1, p1, "q")  # too late: its message is gone


def test_a_chunk_arriving_also_expires_the_old_ones() -> None:
    rs, clock = reassembler(expiry_s=10.0)
    (p0, h0), _ = split(body(2000), 1000)
    rs.take(h0, p0, "old")
    clock.now = 11.0
    other = split(body(200, 5), 100)[0]
    rs.take(other[1], other[0], "new")
    assert len(rs) == 1 and rs.dropped == 1
    assert [f.origin for a in rs.sweep() for f in a.fragments] == ["old"]


def test_brokers_expire_chunks_after_the_reassemblers_default_unless_told() -> None:
    assert BrokerSettings().chunk_expiry_s == chunking.DEFAULT_EXPIRY_S == 120.0
    assert BrokerSettings.from_env({"SHARDSERVE_CHUNK_EXPIRY": "2.5"}).chunk_expiry_s == 2.5


def test_fragments_keep_the_chunk_headers_as_checked() -> None:
    rs, _ = reassembler()
    part, headers = split(body(2000), 1000)[0]
    raw = {**headers, chunking.H_ID: headers[chunking.H_ID].encode(), "x-other": "dropped"}
    rs.take(raw, part, "q")
    with pytest.raises(ChunkError):
        rs.take({**headers, chunking.H_COUNT: 3}, part, "q")
    [abandoned] = rs.sweep()
    assert abandoned.fragments[0].headers == headers  # str id, no other header


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
    assert [rs.take(h, part, "q") for part, h in from_pieces][-1] == data


def test_pieces_that_fit_are_joined_into_one_body_without_headers() -> None:
    assert list(chunking.split_pieces([b"ab", b"", b"cd"], 4)) == [(b"abcd", {})]


def strip_id(headers: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in headers.items() if k != chunking.H_ID}
