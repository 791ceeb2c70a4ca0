"""Bad AMQP messages from Hypothesis: garbage bytes, and valid msgpack that is no message.

The msgpack ones are built from the real message kinds (``shardserve.wire.protocol``):
every field of a kind present or missing, each value of a random msgpack type, huge
numbers, unknown kinds, wrong schema versions, extra keys. Content types and chunk headers
are drawn too. A consumer must dead-letter every one, so the generator keeps only what the
project's own decoding path refuses (``is_refused``, the oracle): the same reassembly and
``codec.decode`` a consumer runs. What it accepts is a valid message, not bad input.

One message in ``LONE_FRAGMENT_SHARE`` is a lone fragment instead: a chunk with plausible
headers (a fresh message id) whose other chunks never come. The decoding path holds it
(``is_held``), so the consumer dead-letters it only when its message expires
(``SHARDSERVE_CHUNK_EXPIRY``, short in the fuzz's mesh).
"""

from __future__ import annotations

import functools
import random
import typing
from dataclasses import dataclass
from typing import Any

import hypothesis
import msgpack
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from pydantic import BaseModel

from shardserve.errors import CodecError
from shardserve.wire import chunking, codec
from shardserve.wire.protocol import SCHEMA_VERSION, Message

CONTENT_TYPES = (codec.CONTENT_TYPE, "application/json", "text/plain", "", None)
HUGE_NUMBERS = (2**64 - 1, -(2**63), 2**63, 1e308, -1e308, float("inf"), float("nan"))
LONE_FRAGMENT_SHARE = 100  # one message in this many is a lone fragment


@dataclass(frozen=True)
class BadMessage:
    label: str  # how it was made: garbage, unknown-kind, kind:<k>, ...
    body: bytes
    content_type: str | None = None
    headers: dict[str, Any] | None = None


def message_kinds() -> dict[str, type[BaseModel]]:
    """kind -> model, for every message the wire knows (read from the protocol's union)."""
    union = typing.get_args(Message)[0]
    models: tuple[type[BaseModel], ...] = typing.get_args(union)
    return {str(m.model_fields["kind"].default): m for m in models}


def is_refused(message: BadMessage) -> bool:
    """Whether a consumer's decoding path raises CodecError on it (it must dead-letter)."""
    try:
        body = _fresh_reassembler().take(message.headers, message.body, None)
        if body is not None:
            codec.decode(body)
    except CodecError:
        return True
    return False


def is_held(message: BadMessage) -> bool:
    """Whether a consumer's decoding path holds it as a chunk of a message to come."""
    return _fresh_reassembler().take(message.headers, message.body, None) is None


def _fresh_reassembler() -> chunking.Reassembler[None]:
    return chunking.Reassembler(max_total_bytes=codec.MAX_MESSAGE_BYTES)


def lone_fragment(rng: random.Random) -> BadMessage:
    """One chunk of a message of 2-4 chunks that never come (a fresh message id)."""
    count = rng.randint(2, 4)
    body = rng.randbytes(rng.randint(1, 256))
    headers = {
        chunking.H_ID: f"{rng.getrandbits(128):032x}",
        chunking.H_INDEX: rng.randrange(count),
        chunking.H_COUNT: count,
        chunking.H_TOTAL: len(body) * count,
    }
    return BadMessage("lone-fragment", body, codec.CONTENT_TYPE, headers)


@functools.cache  # built once: a strategy is costly to build, cheap to draw from
def msgpack_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.sampled_from(HUGE_NUMBERS)
        | st.text(max_size=24)
        | st.binary(max_size=64)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
        ),
        max_leaves=10,
    )


@st.composite
def wrong_fields(draw: st.DrawFn, kinds: dict[str, type[BaseModel]]) -> tuple[str, dict[str, Any]]:
    """A map naming a real kind whose fields are each missing or of a random value."""
    kind = draw(st.sampled_from(sorted(kinds)))
    raw: dict[str, Any] = {"v": draw(st.sampled_from((SCHEMA_VERSION,) * 4 + (0, 99, "1")))}
    raw["kind"] = kind
    for name in kinds[kind].model_fields:
        if name not in ("v", "kind") and draw(st.booleans()):
            raw[name] = draw(msgpack_values())
    if draw(st.integers(0, 9)) == 0:
        raw[draw(st.text(min_size=1, max_size=12))] = draw(msgpack_values())
    return f"kind:{kind}", raw


@st.composite
def unknown_kind(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    fields = draw(st.dictionaries(st.text(max_size=12), msgpack_values(), max_size=6))
    return "unknown-kind", {**fields, "v": SCHEMA_VERSION, "kind": draw(st.text(max_size=30))}


def packed(labelled: tuple[str, Any]) -> tuple[str, bytes]:
    return labelled[0], msgpack.packb(labelled[1], use_bin_type=True)


@functools.cache
def bodies(
    kinds: tuple[tuple[str, type[BaseModel]], ...],
) -> st.SearchStrategy[tuple[str, bytes]]:
    garbage = st.tuples(st.just("garbage"), st.binary(max_size=512))
    not_a_message = st.tuples(st.just("msgpack-value"), msgpack_values())
    maps = wrong_fields(dict(kinds)) | unknown_kind() | not_a_message
    truncated = st.tuples(st.just("truncated"), maps.map(packed).map(lambda p: p[1]))
    cut = truncated.flatmap(
        lambda t: st.integers(0, max(0, len(t[1]) - 1)).map(lambda n: (t[0], t[1][:n]))
    )
    return garbage | maps.map(packed) | cut


@functools.cache
def chunk_headers() -> st.SearchStrategy[dict[str, Any] | None]:
    """Mostly none; sometimes chunk headers of wrong types or out of range."""
    fields = st.fixed_dictionaries(
        {
            chunking.H_ID: st.text(max_size=8) | st.integers(-(2**63), 2**63 - 1),
            chunking.H_INDEX: st.integers(-3, 3) | st.text(max_size=3),
            chunking.H_COUNT: st.integers(-3, 3) | st.none(),
            chunking.H_TOTAL: st.integers(-(2**40), 2**40),
        }
    )
    return st.none() | st.none() | st.none() | fields


@st.composite
def bad_messages(draw: st.DrawFn, kinds: dict[str, type[BaseModel]]) -> BadMessage:
    label, body = draw(bodies(tuple(kinds.items())))
    headers = draw(chunk_headers())
    return BadMessage(
        label if headers is None else f"{label}+chunk-headers",
        body,
        draw(st.sampled_from(CONTENT_TYPES)),
        headers,
    )


def generate(count: int, seed: int = 0, kinds: tuple[str, ...] | None = None) -> list[BadMessage]:
    """``count`` bad messages: refused by the decoding path, and lone fragments (one in
    ``LONE_FRAGMENT_SHARE``, at random places); ``kinds``: made from those kinds only."""
    rng = random.Random(seed)
    messages = refused_messages(count - count // LONE_FRAGMENT_SHARE, seed, kinds)
    for _ in range(count // LONE_FRAGMENT_SHARE):
        messages.insert(rng.randint(0, len(messages)), lone_fragment(rng))
    return messages


def refused_messages(
    count: int, seed: int, only: tuple[str, ...] | None = None
) -> list[BadMessage]:
    """``count`` messages that the decoding path refuses, from Hypothesis."""
    kinds = {k: m for k, m in message_kinds().items() if only is None or k in only}
    found: list[BadMessage] = []
    refused = bad_messages(kinds).filter(is_refused)

    @hypothesis.settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.seed(seed)
    @given(message=refused)
    def collect(message: BadMessage) -> None:
        found.append(message)

    while len(found) < count:
        before = len(found)
        collect()
        if len(found) == before:
            break
    return found[:count]
