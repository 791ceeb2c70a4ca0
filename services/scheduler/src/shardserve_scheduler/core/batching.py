"""Dynamic batching for ``with_batch_dim`` servables; pure, with the caller's clock.

A *piece* is one instance's model inputs (or a chunk of its rows, when the instance is
larger than the maximum batch size). Pieces of different requests are concatenated along
dim 0 up to ``limit`` rows; a batch is flushed when it is full or when its oldest piece
has waited ``delay`` seconds (checked by ``due`` at every event and tick). Inputs declared
without a batch dim are passed through unchanged, so only pieces whose no-batch inputs
are byte-identical share a batch (they are keyed by the digest of those inputs).

A model with a fixed batch dim (``max_batch_size`` > 0 in group.json) gets exactly that
many rows: MindSpore pads with copies of instance 0; we pad with zeros, and the padded
rows are dropped from the outputs.

A model *without* a batch dimension cannot take several instances in one run, but they
can still travel as one job: instances of the same input shapes are *stacked* on a new
leading axis (``stack``/``unstack``); every rank runs its segments once per instance and
exchanges the collectives of all of them in one message (``StageWork.stacked``). The
per-job cost (deliveries, digests, results from every rank) is then paid once for the lot.
Only small instances stack (``STACK_MAX_BYTES``): big ones gain nothing and would make
big messages.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from shardserve.wire.protocol import TensorMap
from shardserve.wire.tensors import Tensor, digest_tensors, tensor_bytes

Member = tuple[str, int, int, int]  # (request key, instance index, chunk index, step position)


@dataclass(frozen=True)
class Piece:
    member: Member
    inputs: TensorMap
    rows: int
    arrived: float
    key: str  # digest of the no-batch inputs: pieces with different keys never mix


@dataclass
class _Open:
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0


def rows_of(inputs: TensorMap, no_batch: Collection[str]) -> int:
    """The instance's row count: dim 0 of its batch inputs, which must agree (ValueError)."""
    sizes = {
        name: t.shape[0] if t.shape else -1 for name, t in inputs.items() if name not in no_batch
    }
    distinct = set(sizes.values())
    if -1 in distinct:
        scalar = next(n for n, s in sizes.items() if s == -1)
        raise ValueError(f"input {scalar!r} has no batch dimension (it is a scalar)")
    if len(distinct) > 1:
        listed = ", ".join(f"{n} has {s}" for n, s in sorted(sizes.items()))
        raise ValueError(f"the inputs disagree on the batch size (dim 0): {listed}")
    rows = distinct.pop() if distinct else 1
    if rows < 1:
        raise ValueError("an instance needs at least one row (dim 0 is 0)")
    return rows


def chunk(inputs: TensorMap, no_batch: Collection[str], rows: int, limit: int) -> list[TensorMap]:
    """Split an instance into pieces of at most ``limit`` rows, in order."""
    if rows <= limit:
        return [inputs]
    pieces: list[TensorMap] = []
    for start in range(0, rows, limit):
        stop = min(rows, start + limit)
        pieces.append(
            {
                name: t if name in no_batch else Tensor.from_numpy(t.to_numpy()[start:stop])
                for name, t in inputs.items()
            }
        )
    return pieces


STACK_MAX_BYTES = 1024 * 1024  # tensor bytes of one instance, at most, to be stacked


def stackable(inputs: TensorMap) -> bool:
    return tensor_bytes(inputs) <= STACK_MAX_BYTES


def stack_key(inputs: TensorMap) -> str:
    """Instances stack only with instances of the same input names, dtypes and shapes."""
    return ";".join(f"{n}:{t.dtype}:{list(t.shape)}" for n, t in sorted(inputs.items()))


def stack(pieces: list[Piece]) -> TensorMap:
    """One job's inputs from several instances: each input stacked on a new axis 0."""
    first = pieces[0].inputs
    return {
        name: _joined([p.inputs[name] for p in pieces], (len(pieces), *tensor.shape))
        for name, tensor in first.items()
    }


def _joined(tensors: list[Tensor], shape: tuple[int, ...], padding: bytes = b"") -> Tensor:
    """Tensors of one dtype and trailing shape, one after the other along axis 0.

    Row-major bytes of a concatenation along axis 0 are the parts' bytes end to end (for
    every dtype, KServe BYTES included), so the join is one copy, not numpy's
    concatenate + ``tobytes`` (two copies of the whole job, a tenth of a batching
    scheduler's CPU)."""
    parts = [t.data for t in tensors]
    if padding:
        parts.append(padding)
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    return Tensor.model_construct(dtype=tensors[0].dtype, shape=shape, data=data)


def unstack(outputs: TensorMap, count: int) -> list[TensorMap]:
    """Each instance's outputs from a stacked job's; ValueError if an output is not stacked."""
    for name, tensor in outputs.items():
        if not tensor.shape or tensor.shape[0] != count:
            raise ValueError(
                f"model output {name!r} has shape {list(tensor.shape)}; expected the "
                f"{count} stacked instances on its first axis"
            )
    arrays = {name: t.to_numpy() for name, t in outputs.items()}
    return [{name: Tensor.from_numpy(a[i]) for name, a in arrays.items()} for i in range(count)]


def batch_key(inputs: TensorMap, no_batch: Collection[str]) -> str:
    """Pieces share a batch only when their no-batch inputs are byte-identical and their
    batch inputs agree on dtype and trailing shape (their rows are concatenated)."""
    layout = ";".join(
        f"{n}:{t.dtype}:{list(t.shape[1:])}" for n, t in sorted(inputs.items()) if n not in no_batch
    )
    return f"{digest_tensors({n: t for n, t in inputs.items() if n in no_batch})}|{layout}"


class Batcher:
    """Open batches of one servable version, keyed by their no-batch inputs."""

    def __init__(self, limit: int, delay: float) -> None:
        self.limit = max(1, limit)
        self.delay = max(0.0, delay)
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        return sum(len(o.pieces) for o in self._open.values())

    def add(self, piece: Piece) -> list[list[Piece]]:
        """Queue a piece; return the batches that became full."""
        full: list[list[Piece]] = []
        batch = self._open.setdefault(piece.key, _Open())
        if batch.rows + piece.rows > self.limit and batch.pieces:
            full.append(batch.pieces)
            batch = self._open[piece.key] = _Open()
        batch.pieces.append(piece)
        batch.rows += piece.rows
        if batch.rows >= self.limit:
            full.append(batch.pieces)
            del self._open[piece.key]
        return full

    def due(self, now: float) -> list[list[Piece]]:
        """Batches whose oldest piece has waited ``delay`` (all of them when delay is 0)."""
        keys = [k for k, b in self._open.items() if b.pieces[0].arrived + self.delay <= now]
        return [self._open.pop(k).pieces for k in keys]

    def next_due(self) -> float | None:
        starts = [b.pieces[0].arrived for b in self._open.values()]
        return min(starts) + self.delay if starts else None

    def clear(self) -> list[Piece]:
        pieces = [p for b in self._open.values() for p in b.pieces]
        self._open.clear()
        return pieces


def combine(
    pieces: list[Piece], no_batch: Collection[str], pad_to: int
) -> tuple[TensorMap, tuple[tuple[int, int], ...]]:
    """One model input from several pieces, and each piece's row range in it."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for piece in pieces:
        ranges.append((start, start + piece.rows))
        start += piece.rows
    inputs: TensorMap = {}
    for name, tensor in pieces[0].inputs.items():
        if name in no_batch:
            inputs[name] = tensor
            continue
        padding = _zero_rows(tensor, pad_to - start) if pad_to > start else b""
        rows = max(pad_to, start)
        joined = _joined([p.inputs[name] for p in pieces], (rows, *tensor.shape[1:]), padding)
        inputs[name] = joined
    return inputs, tuple(ranges)


def _zero_rows(like: Tensor, count: int) -> bytes:
    """The bytes of ``count`` rows of zeros shaped like ``like``'s rows (empty strings for
    BYTES): what a fixed batch dim is padded with."""
    array = like.to_numpy()
    return Tensor.from_numpy(np.zeros((count, *array.shape[1:]), array.dtype)).data


def split(outputs: TensorMap, ranges: tuple[tuple[int, int], ...]) -> list[TensorMap]:
    """Each piece's rows of the batch outputs (padded rows dropped); ValueError if an
    output has fewer rows than the batch."""
    need = ranges[-1][1]
    for name, tensor in outputs.items():
        if not tensor.shape or tensor.shape[0] < need:
            raise ValueError(
                f"model output {name!r} has shape {list(tensor.shape)}; it cannot be split "
                f"into the {need} rows of the batch"
            )
    if len(ranges) == 1 and all(t.shape[0] == need for t in outputs.values()):
        return [outputs]
    arrays = {name: t.to_numpy() for name, t in outputs.items()}
    return [
        {name: Tensor.from_numpy(a[start:stop]) for name, a in arrays.items()}
        for start, stop in ranges
    ]


def join_chunks(chunks: list[TensorMap]) -> TensorMap:
    """An instance's outputs from its chunks' outputs, in order."""
    if len(chunks) == 1:
        return chunks[0]
    return {
        name: Tensor.from_numpy(np.concatenate([c[name].to_numpy() for c in chunks], axis=0))
        for name in chunks[0]
    }
