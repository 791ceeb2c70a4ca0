"""The attention program op: causal attention of a packed step's rows over a rank's KV cache.

A step packs the tokens of several sequences as rows (prefill chunks and decode tokens
mixed, no padding); ``StepLayout`` says which rows belong to which sequence and at which
positions. For each sequence the op writes the rows' K/V into the cache at their
positions, then attends its query rows over every key so far, causally. Everything around
it is per-token and runs in ONNX; this is the only place sequences differ in length, so it
runs in numpy, fp32, batched over heads (one matmul per sequence and layer, not per head).

Grouped-query attention: local query head ``j`` uses local K/V head ``j // group`` with
``group = q_heads / kv_heads`` of the rank (the exporter keeps that true when K/V heads
are split or replicated over ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shardserve.errors import InternalError
from shardserve.runtime.kv_cache import KVCache

__all__ = ["SequenceSpan", "SoleSequence", "StepAttention", "StepLayout", "causal_mask"]


@dataclass(frozen=True)
class SequenceSpan:
    """``count`` consecutive packed rows of ``seq_id``, at positions start..start+count-1."""

    seq_id: int
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class SoleSequence:
    """A step whose rows are all one sequence's: where a composed piece attends in place."""

    span: SequenceSpan
    cache: KVCache

    def layer(self, layer: int) -> np.ndarray:
        """``[2, kv_heads, capacity, head_dim]`` of the sequence (K at [0], V at [1])."""
        return self.cache.layer(self.span.seq_id, layer)


@dataclass(frozen=True)
class _Placed:
    span: SequenceSpan
    first_row: int
    mask: np.ndarray | None  # additive [count, end], None for one row (it sees every key)


class StepLayout:
    """The packed rows of one step, in order; row offsets and causal masks computed once
    per step (not once per layer)."""

    def __init__(self, spans: Sequence[SequenceSpan | tuple[int, int, int]]) -> None:
        placed: list[_Placed] = []
        row = 0
        seen: set[int] = set()
        for item in spans:
            span = item if isinstance(item, SequenceSpan) else SequenceSpan(*item)
            _check_span(span, seen)
            mask = causal_mask(span.start, span.count) if span.count > 1 else None
            placed.append(_Placed(span, row, mask))
            row += span.count
        self.rows = row
        self._placed = tuple(placed)

    @property
    def spans(self) -> tuple[SequenceSpan, ...]:
        return tuple(p.span for p in self._placed)

    def __iter__(self) -> Iterator[_Placed]:
        return iter(self._placed)


def _check_span(span: SequenceSpan, seen: set[int]) -> None:
    if span.start < 0 or span.count < 1:
        raise InternalError(
            f"sequence {span.seq_id}: bad span start {span.start}, count {span.count}"
        )
    if span.seq_id in seen:
        raise InternalError(f"sequence {span.seq_id} appears twice in one step")
    seen.add(span.seq_id)


def causal_mask(start: int, count: int) -> np.ndarray:
    """Additive mask [count, start+count]: query i (at position start+i) sees keys 0..start+i."""
    keys = np.arange(start + count)
    queries = np.arange(start, start + count)[:, None]
    return np.where(keys > queries, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)


class StepAttention:
    """The context an ``attention`` program op calls: one rank's cache and one step's layout."""

    def __init__(self, cache: KVCache, layout: StepLayout) -> None:
        for placed in layout:
            span = placed.span
            if span.end > cache.capacity(span.seq_id):
                raise InternalError(
                    f"sequence {span.seq_id}: positions up to {span.end} exceed its reserved "
                    f"{cache.capacity(span.seq_id)} tokens"
                )
        self.cache = cache
        self.layout = layout

    def sole_sequence(self) -> SoleSequence | None:
        """The step's one sequence, None when it packs several."""
        spans = self.layout.spans
        return SoleSequence(spans[0], self.cache) if len(spans) == 1 else None

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [N, Hq, D], k/v [N, Hkv, D] for the step's N rows -> attention output [N, Hq*D]."""
        rows, q_heads, dim = q.shape
        kv_heads = k.shape[1]
        if rows != self.layout.rows or k.shape != v.shape or k.shape[0] != rows:
            raise InternalError(
                f"attention layer {layer}: q {list(q.shape)}, k {list(k.shape)}, "
                f"v {list(v.shape)} do not fit a step of {self.layout.rows} rows"
            )
        if q_heads % kv_heads != 0:
            raise InternalError(f"{q_heads} query heads cannot share {kv_heads} K/V heads")
        scaled = q * np.float32(1.0 / math.sqrt(dim))
        out = np.empty((rows, q_heads * dim), np.float32)
        for placed in self.layout:
            rows_of = slice(placed.first_row, placed.first_row + placed.span.count)
            kv = self.cache.layer(placed.span.seq_id, layer)
            out[rows_of] = _attend_one(kv, placed, scaled[rows_of], k[rows_of], v[rows_of])
        return out


def _attend_one(
    kv: np.ndarray, placed: _Placed, q: np.ndarray, k: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """One sequence: store its new K/V, attend its (pre-scaled) queries; -> [n, Hq*D]."""
    span = placed.span
    n, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    kv[0, :, span.start : span.end] = k.transpose(1, 0, 2)
    kv[1, :, span.start : span.end] = v.transpose(1, 0, 2)
    keys, values = kv[0, :, : span.end], kv[1, :, : span.end]
    # [n, Hkv*G, D] -> [Hkv, G*n, D]: every query of a K/V head in one matmul.
    grouped = q.reshape(n, kv_heads, group, dim).transpose(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))
    if placed.mask is not None:
        scores = (scores.reshape(kv_heads, group, n, span.end) + placed.mask).reshape(
            kv_heads, group * n, span.end
        )
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    mixed = np.matmul(scores, values)  # [Hkv, G*n, D]
    out: np.ndarray = mixed.reshape(kv_heads, group, n, dim).transpose(2, 0, 1, 3).reshape(n, -1)
    return out
