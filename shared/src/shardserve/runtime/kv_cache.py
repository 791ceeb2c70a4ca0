"""One rank's KV cache: for each live sequence, K and V of every layer of the rank's stage.

A sequence's whole length (prompt + the most tokens it may generate) is reserved at once,
so a step never allocates and a running sequence never runs out of room: admission
control happens at ``reserve``, against a byte budget, and nowhere else. Each sequence's
block is one array ``[layers, 2, kv_heads, capacity, head_dim]`` fp32; K and V of a layer
are views into it, laid out heads-first so the attention op multiplies them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardserve.errors import InternalError, OverloadedError

__all__ = ["CacheShape", "KVCache"]

_FLOAT_BYTES = 4


@dataclass(frozen=True)
class CacheShape:
    """What a rank caches per token: its stage's layers, its K/V heads, the head size."""

    layers: tuple[int, ...]  # the model's layer indices held by this rank's stage
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * 2 * self.kv_heads * self.head_dim * _FLOAT_BYTES


class KVCache:
    """Per-sequence K/V blocks under a byte budget."""

    def __init__(self, shape: CacheShape, budget_bytes: int) -> None:
        self.shape = shape
        self.budget_bytes = budget_bytes
        self._slot = {layer: i for i, layer in enumerate(shape.layers)}
        self._blocks: dict[int, np.ndarray] = {}

    @property
    def bytes_per_token(self) -> int:
        return self.shape.bytes_per_token

    @property
    def used_bytes(self) -> int:
        return sum(block.nbytes for block in self._blocks.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._blocks

    def reserve(self, seq_id: int, capacity: int) -> None:
        """Allocate room for ``capacity`` tokens of ``seq_id``; refuse over the budget."""
        if seq_id in self._blocks:
            raise InternalError(f"sequence {seq_id} already has a KV cache reservation")
        if capacity < 1:
            raise InternalError(f"sequence {seq_id}: capacity must be >= 1, got {capacity}")
        needed = capacity * self.bytes_per_token
        if needed > self.free_bytes:
            raise OverloadedError(
                f"KV cache full: sequence {seq_id} needs {needed} bytes for {capacity} tokens "
                f"({self.bytes_per_token} bytes/token), {self.free_bytes} of "
                f"{self.budget_bytes} bytes free"
            )
        s = self.shape
        self._blocks[seq_id] = np.zeros(
            (len(s.layers), 2, s.kv_heads, capacity, s.head_dim), np.float32
        )

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s block (finished or cancelled); unknown ids are ignored,
        so a cancel racing a finish is harmless."""
        self._blocks.pop(seq_id, None)

    def capacity(self, seq_id: int) -> int:
        return int(self._block(seq_id).shape[3])

    def layer(self, seq_id: int, layer: int) -> np.ndarray:
        """``[2, kv_heads, capacity, head_dim]``: K at [0], V at [1] (views, writable)."""
        slot = self._slot.get(layer)
        if slot is None:
            raise InternalError(f"layer {layer} is not cached here (layers {self.shape.layers})")
        view: np.ndarray = self._block(seq_id)[slot]
        return view

    def _block(self, seq_id: int) -> np.ndarray:
        block = self._blocks.get(seq_id)
        if block is None:
            raise InternalError(f"sequence {seq_id} has no KV cache reservation on this rank")
        return block

    def sequences(self) -> Sequence[int]:
        return tuple(self._blocks)
