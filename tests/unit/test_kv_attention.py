"""The per-rank KV cache and the attention op, against a per-head textbook attention."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from shardserve.errors import InternalError, OverloadedError
from shardserve.runtime.attention import StepAttention, StepLayout, causal_mask
from shardserve.runtime.kv_cache import CacheShape, KVCache

Q_HEADS, KV_HEADS, DIM = 4, 2, 8


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whole-sequence causal attention, one head at a time, in float64. q [T, Hq, D]."""
    t, q_heads, dim = q.shape
    group = q_heads // k.shape[1]
    out = np.zeros((t, q_heads, dim))
    for head in range(q_heads):
        qh, kh, vh = q[:, head], k[:, head // group], v[:, head // group]
        scores = qh.astype(np.float64) @ kh.T / math.sqrt(dim)
        scores[np.triu(np.ones((t, t), bool), 1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = (weights / weights.sum(axis=1, keepdims=True)) @ vh
    return out.reshape(t, q_heads * dim)


def random_qkv(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        rng.standard_normal((t, Q_HEADS, DIM)).astype(np.float32),
        rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32),
        rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32),
    )


def new_cache(layers: tuple[int, ...] = (3,), budget: int = 1 << 20) -> KVCache:
    return KVCache(CacheShape(layers, KV_HEADS, DIM), budget)


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    cache = new_cache(layers=(2, 3, 4))
    assert cache.bytes_per_token == 3 * 2 * KV_HEADS * DIM * 4
    cache.reserve(7, 10)
    assert cache.used_bytes == 10 * cache.bytes_per_token
    assert cache.free_bytes == cache.budget_bytes - cache.used_bytes
    cache.free(7)
    assert cache.used_bytes == 0 and 7 not in cache


def test_reserve_over_budget_is_refused_with_the_numbers() -> None:
    cache = new_cache(budget=100 * 2 * KV_HEADS * DIM * 4)
    cache.reserve(1, 60)
    with pytest.raises(
        OverloadedError, match=r"KV cache full: sequence 2 needs 5248 bytes for 41 tokens"
    ):
        cache.reserve(2, 41)
    cache.reserve(2, 40)
    assert cache.free_bytes == 0


def test_unknown_sequence_and_overflow_are_internal_errors() -> None:
    cache = new_cache()
    with pytest.raises(InternalError, match="no KV cache reservation"):
        StepAttention(cache, StepLayout([(5, 0, 1)]))
    cache.reserve(5, 4)
    with pytest.raises(InternalError, match="exceed its reserved 4 tokens"):
        StepAttention(cache, StepLayout([(5, 2, 3)]))
    with pytest.raises(InternalError, match="appears twice"):
        StepLayout([(5, 0, 1), (5, 1, 1)])


def test_prefill_equals_textbook_attention() -> None:
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 9)
    cache = new_cache()
    cache.reserve(1, 16)
    got = StepAttention(cache, StepLayout([(1, 0, 9)])).attend(3, q, k, v)
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=1e-5)


def test_chunked_prefill_then_decode_equals_one_prefill() -> None:
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 12)
    cache = new_cache()
    cache.reserve(1, 12)
    rows = []
    for start, count in ((0, 5), (5, 4), (9, 1), (10, 1), (11, 1)):
        step = StepAttention(cache, StepLayout([(1, start, count)]))
        part = slice(start, start + count)
        rows.append(step.attend(3, q[part], k[part], v[part]))
    np.testing.assert_allclose(np.concatenate(rows), reference_attention(q, k, v), atol=1e-5)


def test_sequences_of_different_lengths_share_a_step() -> None:
    """A prefill of one sequence and decode tokens of two others, packed in one step."""
    rng = np.random.default_rng(2)
    lengths = {10: 7, 11: 3, 12: 5}
    data = {seq: random_qkv(rng, n) for seq, n in lengths.items()}
    cache = new_cache()
    for seq, n in lengths.items():
        cache.reserve(seq, n)
    # sequences 11 and 12 prefill all but their last token first
    for seq in (11, 12):
        q, k, v = (a[: lengths[seq] - 1] for a in data[seq])
        StepAttention(cache, StepLayout([(seq, 0, lengths[seq] - 1)])).attend(3, q, k, v)
    spans = [(11, 2, 1), (10, 0, 7), (12, 4, 1)]
    picks = [(11, slice(2, 3)), (10, slice(0, 7)), (12, slice(4, 5))]
    packed = [np.concatenate([data[s][i][p] for s, p in picks]) for i in range(3)]
    got = StepAttention(cache, StepLayout(spans)).attend(3, *packed)
    expected = np.concatenate([reference_attention(*data[s])[p] for s, p in picks])
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_layers_are_cached_apart() -> None:
    rng = np.random.default_rng(3)
    cache = new_cache(layers=(0, 1))
    cache.reserve(1, 4)
    a, b = random_qkv(rng, 4), random_qkv(rng, 4)
    for layer, (q, k, v) in ((0, a), (1, b)):
        StepAttention(cache, StepLayout([(1, 0, 3)])).attend(layer, q[:3], k[:3], v[:3])
    for layer, (q, k, v) in ((0, a), (1, b)):
        got = StepAttention(cache, StepLayout([(1, 3, 1)])).attend(layer, q[3:], k[3:], v[3:])
        np.testing.assert_allclose(got, reference_attention(q, k, v)[3:], atol=1e-5)
    with pytest.raises(InternalError, match="layer 5 is not cached"):
        cache.layer(1, 5)


def test_causal_mask_lets_each_query_see_its_past() -> None:
    mask = causal_mask(2, 3)
    assert mask.shape == (3, 5)
    assert [int(np.isfinite(row).sum()) for row in mask] == [3, 4, 5]


def test_wrong_row_count_is_refused() -> None:
    cache = new_cache()
    cache.reserve(1, 8)
    q, k, v = random_qkv(np.random.default_rng(4), 3)
    with pytest.raises(InternalError, match="do not fit a step of 2 rows"):
        StepAttention(cache, StepLayout([(1, 0, 2)])).attend(3, q, k, v)


def decode_step_seconds(sequences: int, layers: int = 8, context: int = 256) -> float:
    """Wall time of the attention op for one decode step (all layers), Hq 16 / Hkv 4 / D 64."""
    q_heads, kv_heads, dim = 16, 4, 64
    cache = KVCache(CacheShape(tuple(range(layers)), kv_heads, dim), 1 << 34)
    for seq in range(sequences):
        cache.reserve(seq, context + 1)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((sequences, q_heads, dim)).astype(np.float32)
    k = rng.standard_normal((sequences, kv_heads, dim)).astype(np.float32)
    step = StepAttention(cache, StepLayout([(s, context, 1) for s in range(sequences)]))
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for layer in range(layers):
            step.attend(layer, q, k, k)
        best = min(best, time.perf_counter() - began)
    return best


def test_decode_step_cost_is_reported() -> None:
    """Measured, printed (pytest -s), and bounded loosely so a 10x regression shows."""
    one, many = decode_step_seconds(1), decode_step_seconds(32)
    print(
        f"\nattention op per decode step, 8 layers, ctx 256: 1 seq {one * 1e3:.2f} ms, "
        f"32 seqs {many * 1e3:.2f} ms"
    )
    assert one < 0.05 and many < 1.0
