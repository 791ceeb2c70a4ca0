"""GGUF Q4_0 and Q8_0 tensors as the blocks onnxruntime's ``MatMulNBits`` reads, exactly.

Both are symmetric blocks of 32 along K with one fp16 scale ``d`` per block:

* Q4_0 (18 bytes a block): ``w = d * (q - 8)``, ``q`` 4-bit unsigned, byte ``j`` holding
  ``q[j]`` in its low nibble and ``q[j + 16]`` in its high one;
* Q8_0 (34 bytes): ``w = d * q``, ``q`` int8.

``MatMulNBits`` computes ``w = scale * (code - zero_point)`` with the default zero point
``2**(bits-1)``: Q4_0's ``q`` is its 4-bit code as it is (zero point 8), Q8_0's ``q + 128`` its
8-bit code (zero point 128), and ``d`` widened to fp32 is its scale; no value is rounded a
second time. Only the nibble order differs: ``MatMulNBits`` keeps element ``2i`` in the low
nibble of byte ``i`` and ``2i + 1`` in the high one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from shardserve.errors import ExportError

__all__ = ["BLOCK", "EXACT_BITS", "NBitsBlocks", "exact_blocks"]

BLOCK = 32
EXACT_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q8_0: 8}


@dataclass(frozen=True)
class NBitsBlocks:
    """A ``[N, K]`` weight in ``MatMulNBits`` layout (default zero point ``2**(bits-1)``)."""

    packed: np.ndarray  # uint8 [N, K / 32, 32 * bits / 8]
    scales: np.ndarray  # float32 [N * K / 32], row-major over (N, block)
    bits: int

    def dequantized(self) -> np.ndarray:
        """``scale * (code - zero point)`` as fp32 ``[N, K]`` (what MatMulNBits multiplies)."""
        codes = _unpack(self.packed) if self.bits == 4 else self.packed.astype(np.float32)
        n, blocks = self.packed.shape[:2]
        scales = self.scales.reshape(n, blocks, 1)
        weight: np.ndarray = (scales * (codes - 2 ** (self.bits - 1))).reshape(n, blocks * BLOCK)
        return weight


def exact_blocks(kind: GGMLQuantizationType, data: np.ndarray, n: int, k: int) -> NBitsBlocks:
    """The ``[n, k]`` tensor's raw GGUF bytes (``data``: uint8 ``[n, bytes per row]``)."""
    if kind not in EXACT_BITS:
        raise ExportError(f"GGUF type {kind.name} has no exact MatMulNBits form (Q4_0, Q8_0 do)")
    if k % BLOCK:
        raise ExportError(f"a row of {k} values is not whole blocks of {BLOCK}")
    per_block = 2 + BLOCK * EXACT_BITS[kind] // 8
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // BLOCK, per_block)
    scales = raw[..., :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    body = raw[..., 2:]
    if kind == GGMLQuantizationType.Q8_0:
        codes = (body.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return NBitsBlocks(np.ascontiguousarray(codes), scales, 8)
    values = np.concatenate([body & 0x0F, body >> 4], axis=-1)  # q[0..15], q[16..31]
    return NBitsBlocks(_pack(values), scales, 4)


def _pack(values: np.ndarray) -> np.ndarray:
    """4-bit values ``[..., 32]`` -> bytes ``[..., 16]``, element 2i low, 2i+1 high."""
    return np.ascontiguousarray((values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8))


def _unpack(packed: np.ndarray) -> np.ndarray:
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)
