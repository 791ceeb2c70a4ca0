"""Tensors on the wire: dtype + shape + raw little-endian bytes, decoded without a copy.

Numeric and bool tensors carry numpy's dtype string (``"<f4"``, ``"|b1"``...). String
tensors (KServe BYTES) use dtype ``"bytes"`` and the binary-extension layout: each
element is a 4-byte little-endian length followed by its bytes, row-major. bfloat16
(KServe BF16) uses dtype ``"bfloat16"``: 2 little-endian bytes per element, the upper
half of the float32 bits (what tritonclient sends); numpy sees it through ``ml_dtypes``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, field_validator

from shardserve.errors import BadInputError

BYTES_DTYPE = "bytes"
# ml_dtypes' registered numpy type name, so np.dtype(BF16_DTYPE) works once it is imported.
BF16_DTYPE = "bfloat16"
MAX_RANK = 16

# numpy dtype string -> KServe v2 datatype name, and back.
DTYPE_TO_DATATYPE: dict[str, str] = {
    "|b1": "BOOL",
    "|u1": "UINT8",
    "<u2": "UINT16",
    "<u4": "UINT32",
    "<u8": "UINT64",
    "|i1": "INT8",
    "<i2": "INT16",
    "<i4": "INT32",
    "<i8": "INT64",
    "<f2": "FP16",
    "<f4": "FP32",
    "<f8": "FP64",
    BF16_DTYPE: "BF16",
    BYTES_DTYPE: "BYTES",
}
DATATYPE_TO_DTYPE: dict[str, str] = {v: k for k, v in DTYPE_TO_DATATYPE.items()}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a numeric wire dtype; bfloat16 comes from ``ml_dtypes`` (not a
    declared dependency: onnx brings it), imported only when a BF16 tensor is used."""
    if dtype != BF16_DTYPE:
        return np.dtype(dtype)
    try:
        import ml_dtypes
    except ImportError:
        raise BadInputError("BF16 needs the ml_dtypes package") from None
    bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a numeric wire dtype (no ml_dtypes needed for bfloat16)."""
    return 2 if dtype == BF16_DTYPE else np.dtype(dtype).itemsize


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (without importing ml_dtypes)."""
    # It reports dtype.str "<V2" (a void type): match it by name, but only for void
    # types: dtype.name builds a string (~4 us), a cost every tensor of every hop paid.
    return dtype.kind == "V" and dtype.name == BF16_DTYPE


class Tensor(BaseModel):
    """A tensor as it travels in a message."""

    model_config = ConfigDict(frozen=True)

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_TO_DATATYPE:
            raise ValueError(f"unsupported tensor dtype {value!r}")
        return value

    @field_validator("shape")
    @classmethod
    def _sane_shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(value) > MAX_RANK or any(d < 0 for d in value):
            raise ValueError(f"invalid tensor shape {list(value)}")
        return value

    @property
    def datatype(self) -> str:
        """KServe v2 datatype name of this tensor."""
        return DTYPE_TO_DATATYPE[self.dtype]

    def to_numpy(self) -> np.ndarray:
        """Return a read-only numpy view of the bytes (no copy for numeric dtypes)."""
        if self.dtype == BYTES_DTYPE:
            return unpack_bytes_elements(self.data, self.shape)
        dtype = numpy_dtype(self.dtype)
        # math.prod: exact (np.prod wraps past int64) and ~20x cheaper on a short tuple.
        count = math.prod(self.shape)
        if count * dtype.itemsize != len(self.data):
            raise BadInputError(
                f"tensor data has {len(self.data)} bytes, shape {list(self.shape)} "
                f"of {self.datatype} needs {count * dtype.itemsize}"
            )
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        """Wrap a numpy array; numeric arrays are made contiguous little-endian first."""
        if array.dtype == np.object_ or array.dtype.kind in "SU":
            return cls(dtype=BYTES_DTYPE, shape=array.shape, data=pack_bytes_elements(array))
        shape = tuple(array.shape)  # ascontiguousarray turns a 0-d array into shape (1,)
        array = np.ascontiguousarray(array)
        if is_bfloat16(array.dtype):
            # ml_dtypes stores bfloat16 in native order: write its bits as little-endian.
            data = array.view(np.uint16).astype("<u2", copy=False).tobytes()
            return cls.model_construct(dtype=BF16_DTYPE, shape=shape, data=data)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype.str not in DTYPE_TO_DATATYPE:
            raise BadInputError(f"unsupported tensor dtype {array.dtype}")
        return cls.model_construct(dtype=array.dtype.str, shape=shape, data=array.tobytes())


def pack_bytes_elements(array: np.ndarray) -> bytes:
    """Serialize a string/bytes array as length-prefixed elements (KServe BYTES layout)."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def unpack_bytes_elements(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """Parse length-prefixed elements into an object array of ``bytes`` of this shape."""
    count = math.prod(shape)
    items: list[bytes] = []
    offset = 0
    view = memoryview(data)
    for _ in range(count):
        if offset + 4 > len(data):
            raise BadInputError("BYTES tensor is shorter than its shape says")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(data):
            raise BadInputError("BYTES element length runs past the end of the tensor")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise BadInputError("BYTES tensor has bytes left over after its last element")
    out = np.empty(count, dtype=np.object_)
    out[:] = items
    return out.reshape(shape)


# Every digest names its function, so a process of another shardserve version is told
# apart from corrupted bytes (foreign_digest) instead of failing as a mismatch.
DIGEST_PREFIX = "xxh3:"


def tensor_bytes(tensors: Mapping[str, Tensor]) -> int:
    """The data bytes of a tensor map (what its message carries beyond a few headers)."""
    return sum(len(t.data) for t in tensors.values())


def digest_tensors(tensors: Mapping[str, Tensor]) -> str:
    """Return a digest over names, dtypes, shapes and bytes, independent of dict order.

    XXH3-128: the digest proves that every rank got (and sent) the same bytes, against
    accidents, not an adversary (the broker is inside the trust boundary), and every
    StageWork is digested by the scheduler and again by each rank, so speed decides:
    1.5 MiB (a stacked TP8 job) takes 37 us here against 1,180 us with SHA-256 (SHA-NI).
    Every process of a mesh must use the same function; ``foreign_digest`` names the
    mismatch when one does not."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(b"\0")
        h.update(t.dtype.encode())
        h.update(repr(t.shape).encode())
        h.update(len(t.data).to_bytes(8, "little"))
        h.update(t.data)
    return DIGEST_PREFIX + h.hexdigest()


def digest_mismatch(expected: str, actual: str, otherwise: str) -> str:
    """'' when the digests agree; else why: ``foreign_digest``'s reason when ``expected``
    comes from another function, ``otherwise`` when the bytes differ."""
    if actual == expected:
        return ""
    return foreign_digest(expected) or otherwise


def foreign_digest(digest: str) -> str:
    """'' when ``digest`` comes from ``digest_tensors``, else why it cannot be checked."""
    if digest.startswith(DIGEST_PREFIX):
        return ""
    return (
        f"digest {digest[:16]!r} is not an {DIGEST_PREFIX[:-1]} digest: the sender runs "
        "another shardserve version (every process of a mesh must run the same one)"
    )
