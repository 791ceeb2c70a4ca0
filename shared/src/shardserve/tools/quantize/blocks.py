"""Block-wise symmetric weight quantization in onnxruntime's ``MatMulNBits`` layout.

A weight ``W [N, K]`` (one row per output column) is cut along K into blocks of
``block_size`` values (the last block zero-padded). Each block has one float32 scale ``s``
and stores ``q = round(w / s) + z`` in ``bits`` unsigned bits, with the default zero point
``z = 2**(bits-1)`` (no ``zero_points`` input: symmetric), so ``w ~ (q - z) * s``.
The scale maps the block's value of largest magnitude onto ``-z`` (as llama.cpp's Q4_0
does), which uses the whole signed range ``[-z, z-1]``; for 4 bits a search over smaller
scales keeps, per block, the one with the least squared error.

Packed layout (``MatMulNBits`` input B): uint8 ``[N, K_blocks, block_size * bits / 8]``;
4-bit values two per byte, the even index in the low nibble. Scales: float32
``[N * K_blocks]``, row-major over ``(N, K_blocks)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardserve.errors import ExportError

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedBlocks",
    "check_block_size",
    "dequantize",
    "quantize_blocks",
]

SUPPORTED_BITS = (4, 8)
# Scale shrink factors tried per block by the error search (1.0 = the plain max scale).
SEARCH_ALPHAS = np.linspace(0.7, 1.0, 16, dtype=np.float32)
SEARCH_ROWS = 256


@dataclass(frozen=True)
class QuantizedBlocks:
    """A quantized ``[N, K]`` weight: packed codes, scales and the shape it came from."""

    packed: np.ndarray  # uint8 [N, K_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [N * K_blocks]
    bits: int
    block_size: int
    k: int
    n: int

    def __post_init__(self) -> None:
        check_block_size(self.bits, self.block_size)
        blocks = -(-self.k // self.block_size)
        want = (self.n, blocks, self.block_size * self.bits // 8)
        if self.packed.dtype != np.uint8 or self.packed.shape != want:
            raise ExportError(
                f"packed blocks are {self.packed.dtype} {self.packed.shape}, expected uint8 {want}"
            )
        if self.scales.dtype != np.float32 or self.scales.shape != (self.n * blocks,):
            raise ExportError(
                f"scales are {self.scales.dtype} {self.scales.shape}, "
                f"expected float32 ({self.n * blocks},)"
            )


def check_block_size(bits: int, block_size: int) -> None:
    """``MatMulNBits`` takes 4 or 8 bits and power-of-two blocks of at least 16."""
    if bits not in SUPPORTED_BITS:
        raise ExportError(f"quantization bits must be one of {SUPPORTED_BITS}, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ExportError(f"block size must be a power of two >= 16, got {block_size}")


def quantize_blocks(
    weight: np.ndarray, bits: int, block_size: int, *, search: bool | None = None
) -> QuantizedBlocks:
    """Quantize ``weight [N, K]`` (float); ``search`` (default: for 4 bits) picks each
    block's scale by least squared error instead of the plain max scale."""
    check_block_size(bits, block_size)
    if weight.ndim != 2:
        raise ExportError(f"a weight to quantize must be 2-D [N, K], got shape {weight.shape}")
    n, k = weight.shape
    blocks = _as_blocks(np.asarray(weight, dtype=np.float32), block_size)
    zero = 1 << (bits - 1)
    scales = _max_scales(blocks, zero)
    if search if search is not None else bits == 4:
        scales = _searched_scales(blocks, scales, zero)
    codes = _codes(blocks, scales, zero)
    return QuantizedBlocks(_pack(codes, bits), scales.reshape(-1), bits, block_size, k, n)


def dequantize(q: QuantizedBlocks) -> np.ndarray:
    """The float32 ``[N, K]`` weight the blocks stand for: ``(code - zero) * scale``."""
    zero = 1 << (q.bits - 1)
    codes = _unpack(q.packed, q.bits).astype(np.float32) - np.float32(zero)
    scales = q.scales.reshape(q.n, -1, 1)
    weight: np.ndarray = (codes * scales).reshape(q.n, -1)[:, : q.k]
    return weight


def _as_blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """``[N, K]`` -> ``[N, K_blocks, block_size]``, the tail zero-padded."""
    n, k = weight.shape
    pad = -k % block_size
    if pad:
        weight = np.pad(weight, ((0, 0), (0, pad)))
    return weight.reshape(n, -1, block_size)


def _max_scales(blocks: np.ndarray, zero: int) -> np.ndarray:
    """Per block: the value of largest magnitude (with its sign) divided by ``-zero``."""
    index = np.abs(blocks).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(blocks, index, axis=-1)[..., 0]
    return (peak / np.float32(-zero)).astype(np.float32)


def _codes(blocks: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    """Signed codes shifted by ``zero`` into ``[0, 2*zero)`` (round half to even)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scales[..., None] != 0, blocks / scales[..., None], 0.0)
    return (np.clip(np.rint(ratio), -zero, zero - 1) + zero).astype(np.uint8)


def _searched_scales(blocks: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    """Per block, the scale ``alpha * max scale`` with the least squared error (rows in
    chunks, so the temporaries stay in cache)."""
    best = scales.copy()
    for start in range(0, len(blocks), SEARCH_ROWS):
        rows = slice(start, start + SEARCH_ROWS)
        best[rows] = _search_rows(blocks[rows], scales[rows], zero)
    return best


def _search_rows(blocks: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    best, best_error = scales, np.full(scales.shape, np.inf, dtype=np.float32)
    work = np.empty_like(blocks)
    for alpha in SEARCH_ALPHAS:
        trial = (scales * alpha).astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(blocks, trial, out=work)
        np.nan_to_num(work, copy=False, nan=0.0)  # all-zero blocks: scale 0, codes zero
        np.rint(work, out=work)
        np.clip(work, -zero, zero - 1, out=work)
        np.multiply(work, trial, out=work)
        np.subtract(work, blocks, out=work)
        np.square(work, out=work)
        error = work.sum(axis=-1)
        better = error < best_error
        best = np.where(better, trial[..., 0], best)
        best_error = np.where(better, error, best_error)
    return best.astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes
