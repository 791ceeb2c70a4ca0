"""Collective parts on the hot path: ``Part`` in memory, and its lean wire form.

A tensor-parallel decode step sends a few dozen small parts per rank (17 of 4 KiB for
bench-large at TP 2), each on the critical path: every microsecond spent on a part at
either end is wall time. So between a rank's ``CollectiveHub`` and its transport a part
is a plain ``Part`` (the array as it is, no pydantic model to build), and on the wire a
fixed binary header followed by the array's bytes, read with one ``struct`` unpack, every
field checked, the array a view of the body (no copy)::

    magic    4 bytes  b"SSP1" (shardserve part, layout 1)
    stage    u32      |
    step     u32      |  little-endian, 24 bytes in all
    rank     u32      |
    phase    u8       0 part, 1 shard, 2 reduced
    ndim     u8       at most MAX_RANK
    dtype    u16      length of the dtype text
    job      u32      length of the job id (UTF-8)
    shape    ndim x u64
    dtype    ASCII    a numeric wire dtype ("<f4", "bfloat16", ...)
    job      UTF-8
    data     the rest: exactly prod(shape) x itemsize bytes, little-endian

The magic is not valid msgpack for a message (a positive fixint followed by more bytes),
so a consumer tells the two forms apart by it and ``codec.decode`` refuses a lean body.
Anything malformed raises ``PartError`` (a ``CodecError``): the consumer drops it with a
log line and dead-letters it, as it does any undecodable message. A part the lean form
cannot carry (a dtype without fixed-size elements, numbers past 32 bits) travels as the
``CollectivePart`` message (``Part.message``), which every collective consumer also reads.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shardserve.errors import CodecError, ShardserveError
from shardserve.wire.protocol import CollectivePart
from shardserve.wire.tensors import (
    BF16_DTYPE,
    BYTES_DTYPE,
    DTYPE_TO_DATATYPE,
    MAX_RANK,
    Tensor,
    dtype_itemsize,
    is_bfloat16,
    numpy_dtype,
)

MAGIC = b"SSP1"
_HEAD = struct.Struct("<4sIIIBBHI")
PartPhase = Literal["part", "shard", "reduced"]
PHASES: tuple[PartPhase, ...] = ("part", "shard", "reduced")
_PHASE_CODES = {name: code for code, name in enumerate(PHASES)}
# The dtypes a lean part carries (fixed-size elements), with their element size.
_ITEMSIZE = {d: dtype_itemsize(d) for d in DTYPE_TO_DATATYPE if d != BYTES_DTYPE}
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_RANK + 1)]  # by dimension count
_U32 = 2**32


class PartError(CodecError):
    """A body that starts like a lean part but is not a well-formed one."""


@dataclass(frozen=True, slots=True)
class Part:
    """One rank's contribution to collective ``step`` of a job's stage (see
    ``CollectivePart``, its message form, for the fields)."""

    job: str
    stage: int
    step: int
    rank: int
    phase: PartPhase
    array: np.ndarray

    def message(self) -> CollectivePart:
        """The part as a wire message (made from our own values: no validation)."""
        return CollectivePart.model_construct(
            job=self.job,
            stage=self.stage,
            step=self.step,
            rank=self.rank,
            tensor=Tensor.from_numpy(self.array),
            phase=self.phase,
        )


def is_lean(body: bytes | bytearray | memoryview) -> bool:
    """Whether ``body`` is in the lean form (else it is a msgpack message, or garbage)."""
    return body[:4] == MAGIC


def encode(part: Part) -> list[bytes | memoryview] | None:
    """The part's lean form as pieces (header, the array's own bytes) that make the body
    when joined; None for a part the form cannot carry."""
    job = part.job.encode()
    fits = 0 <= part.stage < _U32 and 0 <= part.step < _U32 and 0 <= part.rank < _U32
    found = _wire_array(part.array)
    if found is None or not fits or len(job) >= _U32 or part.array.ndim > MAX_RANK:
        return None
    dtype, data = found
    head = _HEAD.pack(
        MAGIC,
        part.stage,
        part.step,
        part.rank,
        _PHASE_CODES[part.phase],
        part.array.ndim,
        len(dtype),
        len(job),
    )
    shape = _SHAPES[part.array.ndim].pack(*part.array.shape)
    return [head + shape + dtype + job, data]


def _wire_array(array: np.ndarray) -> tuple[bytes, memoryview] | None:
    """(wire dtype, the bytes of the array, contiguous and little-endian), or None for a
    dtype the lean form does not carry."""
    if is_bfloat16(array.dtype):
        bits = np.ascontiguousarray(array).view(np.uint16).astype("<u2", copy=False)
        return BF16_DTYPE.encode(), bits.reshape(-1).data.cast("B")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.dtype.str not in _ITEMSIZE:
        return None
    flat = np.ascontiguousarray(array).reshape(-1)
    return array.dtype.str.encode(), flat.data.cast("B")


def decode(body: bytes) -> Part:
    """The part in a lean body, every header field checked (PartError says what is
    wrong); its array is a read-only view of ``body``."""
    if len(body) < _HEAD.size:
        raise PartError(f"lean part of {len(body)} bytes is shorter than its header")
    magic, stage, step, rank, phase, ndim, dtype_len, job_len = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise PartError(f"not a lean part (magic {magic!r})")
    if phase >= len(PHASES) or ndim > MAX_RANK:
        raise PartError(f"lean part with phase code {phase} and {ndim} dimensions")
    shapes = _SHAPES[ndim]
    at = _HEAD.size + shapes.size
    data_at = at + dtype_len + job_len
    if data_at > len(body):
        raise PartError(f"lean part of {len(body)} bytes is shorter than its header says")
    shape: tuple[int, ...] = shapes.unpack_from(body, _HEAD.size)
    dtype, job = _text(body, at, dtype_len, "dtype"), _text(body, at + dtype_len, job_len, "job")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise PartError(f"lean part of job {job!r} has unsupported dtype {dtype!r}")
    count = math.prod(shape)
    if count * itemsize != len(body) - data_at:
        raise PartError(
            f"lean part of job {job!r}: shape {list(shape)} of {dtype} needs "
            f"{count * itemsize} bytes, {len(body) - data_at} came"
        )
    array = np.frombuffer(body, _numpy_dtype(dtype), count, data_at).reshape(shape)
    return Part(job, stage, step, rank, PHASES[phase], array)


_NUMPY = {d: np.dtype(d) for d in _ITEMSIZE if d != BF16_DTYPE}


def _numpy_dtype(dtype: str) -> np.dtype:
    known = _NUMPY.get(dtype)
    if known is not None:
        return known
    try:
        return numpy_dtype(dtype)
    except ShardserveError as exc:  # bfloat16 without ml_dtypes
        raise PartError(f"lean part of dtype {dtype}: {exc}") from None


def _text(body: bytes, at: int, length: int, what: str) -> str:
    try:
        return body[at : at + length].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PartError(f"lean part whose {what} is not UTF-8: {exc}") from None
