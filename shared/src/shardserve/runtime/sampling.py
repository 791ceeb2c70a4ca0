"""The next token of each logit row, as the last stage's leader picks it.

``sample_rows(logits, rows)`` takes the float32 logits ``[M, V]`` of a step and one
``RowSampling`` per row (same order) and returns the chosen ids, for rows that asked their
logprobs, and the rows that could not be sampled (``SampledRows``). The choice of a row
depends only on its logits, seed and index, never on the other rows of the batch, so a
sequence samples the same tokens alone or among 63 others:

* ``temperature == 0``: greedy, ``np.argmax`` (the lowest id wins a tie);
* otherwise ``w = exp((logits - max) / temperature)`` (in float64); candidates ordered by
  decreasing weight, ties by increasing id; the first ``top_k`` kept (0: all); then the
  nucleus: the shortest head of that order whose mass reaches ``top_p`` of the kept
  candidates' mass (at least one token); then one draw
  ``u = np.random.default_rng([seed, index]).random()`` picks from the kept ids by inverse CDF
  of their weights in id order (id order, so that with no cut nothing needs sorting).

Before the choice (greedy or drawn), a row that asks has its logits adjusted, in float64, in
vLLM's order: ``repetition_penalty`` p divides the positive logits and multiplies the negative
ones of every distinct id of ``prompt_ids`` and ``output_ids``; ``frequency_penalty`` times an
id's count in ``output_ids`` plus ``presence_penalty`` (once) is subtracted; ``logit_bias`` is
added; while ``index < min_tokens`` the ``masked_until_min`` ids (EOS, stop ids) are -inf.

Logprobs (``logprobs`` N not None): log_softmax of the RAW logits (before temperature, as
OpenAI reports them), the chosen token's and the top N (by logprob descending, then id
ascending). Their ``text`` fields are "": the agent has no tokenizer; the scheduler fills
them in (``TextModel.with_texts``).

A row that is not finite (a NaN, +inf, or nothing but -inf: the model's numerics broke for
that sequence, not a token to pick) is ``broken``: its token is ``BROKEN_ROW_TOKEN`` (a valid
id, so a decode run can feed it back), no logprobs, and the caller ends that sequence alone;
the other rows are sampled as ever (rows never mix in the model: a NaN stays in its own).

Errors: InternalError when the rows do not match the logits.

Cost: the cuts need the head of the order, not a sort of the row: ``top_ids`` partitions a
strided sample to find a threshold and then only the values above it. A flat distribution's
nucleus (most of the row) needs a sort of the values; a peaked one's fits in 256 or 2048.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shardserve.errors import InternalError
from shardserve.wire.protocol import RowSampling, TokenLogprob, TopLogprob

__all__ = [
    "BROKEN_ROW_TOKEN",
    "SampledRows",
    "adjusted_logits",
    "broken_rows",
    "sample_row",
    "sample_rows",
    "top_ids",
]

FloatRow = npt.NDArray[np.float64]
IdArray = npt.NDArray[np.int64]

# Candidates sorted, in turn, when looking for the nucleus: a peaked distribution's nucleus is
# in the first few hundred. When none holds top_p of the mass (a flat distribution), all values
# are sorted. The cumulative sums of a head are those a full sort starts with: same token.
NUCLEUS_HEADS = (256, 2048)
# Smallest strided sample top_ids partitions to find its threshold: a small ``count`` (logprobs'
# top 5) still gets a threshold that about 2 * count + len / POOL_SAMPLE values reach.
POOL_SAMPLE = 512
BROKEN_ROW_TOKEN = 0  # the token of a row that is not finite (ignored: its sequence ends)


class SampledRows(NamedTuple):
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    broken: tuple[int, ...]  # indexes of the rows that were not finite (ascending)


def sample_rows(logits: npt.NDArray[np.float32], rows: Sequence[RowSampling]) -> SampledRows:
    """Choose one token per finite logit row; the logprobs of rows that asked."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise InternalError(f"logits of shape {logits.shape} for {len(rows)} sampled rows")
    broken = broken_rows(logits)
    tokens = _greedy_tokens(logits)
    for i, row in enumerate(rows):
        if i in broken:
            tokens[i] = BROKEN_ROW_TOKEN
        elif row.temperature > 0:
            tokens[i] = sample_row(logits[i], row)
        elif row.adjusts_logits:
            tokens[i] = int(np.argmax(adjusted_logits(logits[i], row)))
    logprobs = [
        None
        if row.logprobs is None or i in broken
        else _logprobs(logits[i], tokens[i], row.logprobs)
        for i, row in enumerate(rows)
    ]
    return SampledRows(tokens, logprobs, broken)


def broken_rows(logits: npt.NDArray[np.float32]) -> tuple[int, ...]:
    """Rows with a NaN anywhere, +inf, or nothing but -inf. (A row's max is NaN when any
    entry is: one cheap pass finds them all.)"""
    return tuple(int(i) for i in np.flatnonzero(~np.isfinite(logits.max(axis=1))))


def _greedy_tokens(logits: npt.NDArray[np.float32]) -> list[int]:
    """argmax of every row at once (a comparison only: no float arithmetic to vary)."""
    return [int(token) for token in np.argmax(logits, axis=1)]


def sample_row(logits: npt.NDArray[np.float32], row: RowSampling) -> int:
    """One row's token with temperature > 0 (see the module docstring for the rule)."""
    # Shifted before the division: every value is <= 0, so dividing by any temperature
    # (even a subnormal one) gives 0 or a negative number, never inf - inf = NaN.
    shifted = adjusted_logits(logits, row)
    shifted -= shifted.max()
    with np.errstate(over="ignore"):  # -x / subnormal overflows to -inf: weight 0, meant
        weights = np.exp(shifted / row.temperature)
    kept = _kept_ids(weights, row.top_k, row.top_p)
    mass = np.cumsum(weights if kept is None else weights[kept])
    draw = np.random.default_rng([row.seed, row.index]).random() * mass[-1]
    chosen = min(int(np.searchsorted(mass, draw, side="right")), len(mass) - 1)
    return chosen if kept is None else int(kept[chosen])


def adjusted_logits(logits: npt.NDArray[np.float32], row: RowSampling) -> FloatRow:
    """The row's logits in float64 after its penalties, bias and min_tokens mask."""
    adjusted = logits.astype(np.float64)
    if row.repetition_penalty != 1.0:
        seen = np.unique(np.asarray((*row.prompt_ids, *row.output_ids), dtype=np.int64))
        values = adjusted[seen]
        adjusted[seen] = np.where(
            values > 0, values / row.repetition_penalty, values * row.repetition_penalty
        )
    if row.output_ids and (row.presence_penalty or row.frequency_penalty):
        ids, counts = np.unique(np.asarray(row.output_ids, dtype=np.int64), return_counts=True)
        adjusted[ids] -= row.frequency_penalty * counts + row.presence_penalty
    for entry in row.logit_bias:
        adjusted[entry.token_id] += entry.bias
    if row.index < row.min_tokens and row.masked_until_min:
        adjusted[np.asarray(row.masked_until_min, dtype=np.int64)] = -np.inf
    return adjusted


def _kept_ids(weights: FloatRow, top_k: int, top_p: float) -> IdArray | None:
    """Ids (ascending) left after the top_k and top_p cuts; None when nothing is cut."""
    vocab = weights.shape[0]
    if 0 < top_k < vocab:
        order = top_ids(weights, top_k)
        mass = np.cumsum(weights[order])
        return np.sort(order[: _nucleus_size(mass, top_p * mass[-1])])
    if top_p >= 1.0:
        return None
    target = top_p * float(weights.sum())
    reach = target  # an upper bound of the mass the next head can hold: unknown at first
    for size in NUCLEUS_HEADS:
        if size >= vocab or reach < target:
            break
        head = top_ids(weights, size)
        mass = np.cumsum(weights[head])
        if mass[-1] >= target:
            return np.sort(head[: _nucleus_size(mass, target)])
        # No weight past a head exceeds the head's mean: k times the size holds <= k times it.
        reach = mass[-1] * NUCLEUS_HEADS[-1] / size
    return _flat_nucleus(weights, target)


def _nucleus_size(mass: FloatRow, target: float) -> int:
    """The shortest head whose cumulative mass reaches ``target``; at least one token."""
    return min(int(np.searchsorted(mass, target, side="left")) + 1, len(mass))


def _flat_nucleus(weights: FloatRow, target: float) -> IdArray:
    """The nucleus of a flat distribution: sorting the values alone (not their ids) finds
    the weight at its edge; the ids are then those above it, and the lowest-id ties."""
    descending = np.sort(weights)[::-1]
    size = _nucleus_size(np.cumsum(descending), target)
    edge = descending[size - 1]
    kept = weights > edge
    kept[np.flatnonzero(weights == edge)[: size - int(kept.sum())]] = True
    return np.flatnonzero(kept).astype(np.int64)  # ascending: no sort of thousands of ids


def top_ids(values: npt.NDArray[np.floating], count: int) -> IdArray:
    """Ids of the ``count`` largest values, largest first, ties by lower id first."""
    size = values.shape[0]
    if count >= size:
        # A stable sort keeps equal values in id order.
        return np.argsort(-values, kind="stable").astype(np.int64)
    pool = _pool_holding_top(values, count)
    pooled = values[pool]
    threshold = np.partition(pooled, len(pool) - count)[len(pool) - count]
    above = pool[pooled > threshold]
    tied = pool[pooled == threshold][: count - len(above)]
    chosen = np.sort(np.concatenate((above, tied)))
    return chosen[np.argsort(-values[chosen], kind="stable")].astype(np.int64)


def _pool_holding_top(values: npt.NDArray[np.floating], count: int) -> IdArray:
    """Ids (ascending) of every value >= a threshold that at least ``count`` values reach, so
    the top ``count`` (ties included) are all in it. The threshold comes from a strided
    sample: partitioning a few hundred values instead of the whole row is what makes it cheap."""
    stride = len(values) // max(8 * count, POOL_SAMPLE)
    if stride < 2:
        return np.arange(len(values), dtype=np.int64)
    sample = values[::stride]
    rank = min(len(sample), 2 * -(-count // stride) + 1)  # aim at about 2 * count values
    threshold = np.partition(sample, len(sample) - rank)[len(sample) - rank]
    pool = np.flatnonzero(values >= threshold)
    if len(pool) < count:  # an unlucky sample: fall back to the whole row
        return np.arange(len(values), dtype=np.int64)
    return pool.astype(np.int64)


def _log_softmax(logits: npt.NDArray[np.float32]) -> FloatRow:
    row = logits.astype(np.float64)
    shifted = row - row.max()
    logprobs: FloatRow = shifted - np.log(np.exp(shifted).sum())
    return logprobs


def _logprobs(logits: npt.NDArray[np.float32], token: int, count: int) -> TokenLogprob:
    logprob = _log_softmax(logits)
    top = top_ids(logprob, count) if count > 0 else np.empty(0, dtype=np.int64)
    return TokenLogprob(
        token_id=token,
        text="",
        logprob=float(logprob[token]),
        top=tuple(TopLogprob(token_id=int(i), text="", logprob=float(logprob[i])) for i in top),
    )
