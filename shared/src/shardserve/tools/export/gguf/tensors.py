"""A GGUF file's tensors under Hugging Face names, as fp32.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``), stores shapes
fastest-dimension first, and for the ``llama`` architecture permutes the rows of the Q and
K projections so that its rotary kernel sees each head's pairs side by side; this undoes
that (exactly as transformers' GGUF loader does) so that the Hugging Face graph's
``rotate_half`` rotary applies. Quantized types are dequantized with the ``gguf`` package;
linear weights can also be handed out as ``MatMulNBits`` blocks (``blocks``): Q8_0 and Q4_0
exactly, and, when served as the file's types (``precision``), the other quantized types
dequantized and re-quantized at the precision they are served at.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, dequantize

from shardserve.errors import ExportError
from shardserve.tools.export.gguf.blocks import BLOCK, EXACT_BITS, exact_blocks
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.gguf.precision import served_bits
from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.quantize import QuantizedBlocks, quantize_blocks

__all__ = ["GgufTensors", "hf_to_gguf_name"]

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Projections the Hugging Face exporter fuses into one linear layer (one MatMulNBits).
_FUSED = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


def fused_with(name: str) -> tuple[str, ...]:
    """The Hugging Face weights fused with ``name`` into one linear layer (itself included)."""
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match[3] != "weight":
        return (name,)
    for group in _FUSED:
        if match[2] in group:
            return tuple(f"model.layers.{match[1]}.{part}.weight" for part in group)
    return (name,)


def hf_to_gguf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match[2] not in _LAYER:
        return None
    return f"blk.{match[1]}.{_LAYER[match[2]]}.{match[3]}"


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, rows [0, 2, 4, ..., 1, 3, ...] back in order."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GgufTensors:
    """The exporter's ``TensorSource`` over a GGUF file."""

    def __init__(
        self,
        file: GgufFile,
        config: DecoderConfig,
        progress: Callable[[str], None] | None = None,
        *,
        keep_blocks: bool = False,
        as_served: bool = False,
    ) -> None:
        """``keep_blocks``: hand out Q8_0/Q4_0 blocks (an export that quantizes keeps them);
        ``as_served``: hand out every quantized linear weight's blocks at the precision its
        type is served at (``precision``: an export without ``--quantize``)."""
        self.file, self.config = file, config
        self.keep_blocks, self.as_served = keep_blocks or as_served, as_served
        self._permuted = file.get("general.architecture") == "llama"
        self._progress = progress

    def _tensor(self, name: str):  # type: ignore[no-untyped-def]
        gguf_name = hf_to_gguf_name(name)
        tensor = self.file.tensors.get(gguf_name) if gguf_name else None
        if tensor is None:
            raise ExportError(
                f"GGUF file {self.file.path.name} has no tensor {gguf_name or name!r}"
            )
        return tensor

    def __contains__(self, name: object) -> bool:
        gguf_name = hf_to_gguf_name(name) if isinstance(name, str) else None
        return gguf_name is not None and gguf_name in self.file.tensors

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        tensor = self._tensor(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if shape != expected:
            raise ExportError(
                f"GGUF tensor {tensor.name!r} has shape {list(shape)}, the metadata implies "
                f"{list(expected)}"
            )

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """``name[rows, cols]`` as C-contiguous fp32, in the Hugging Face layout."""
        tensor = self._tensor(name)
        kind = GGMLQuantizationType(tensor.tensor_type)
        try:
            whole = dequantize(tensor.data, kind)
        except NotImplementedError as exc:
            raise ExportError(f"GGUF tensor {tensor.name!r}: type {kind.name} unsupported") from exc
        shape = tuple(int(d) for d in reversed(tensor.shape))
        whole = np.asarray(whole, dtype=np.float32).reshape(shape)
        whole = self._unpermuted(name, whole)
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        return np.ascontiguousarray(whole[index], dtype=np.float32)

    def blocks(
        self, name: str, rows: slice | None = None, cols: slice | None = None
    ) -> QuantizedBlocks | None:
        """``name[rows, cols]`` as ``MatMulNBits`` blocks, or None: Q8_0/Q4_0 as the file's
        own blocks (no rounding) where ``cols`` (a K split) falls on 32-value block bounds;
        with ``as_served``, any other quantized weight dequantized and rounded to blocks of
        32 at the precision it is served at (``precision``, shared by weights fused with it)."""
        if not self.keep_blocks:
            return None
        tensor = self._tensor(name)
        kind = GGMLQuantizationType(tensor.tensor_type)
        n, k = (int(d) for d in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        cols = cols or slice(0, k)
        bits = self.served_bits(name) if self.as_served else EXACT_BITS.get(kind)
        if bits is None or not n:
            return None
        if EXACT_BITS.get(kind) == bits and not (cols.start % BLOCK or cols.stop % BLOCK):
            return self._exact(name, kind, n, k, rows, cols)
        if kind in EXACT_BITS:
            self._say(self._why_rounded(tensor.name, kind, bits, cols))
        if not self.as_served:
            return None
        return quantize_blocks(self.read(name, rows, cols), bits, BLOCK)

    @staticmethod
    def _why_rounded(gguf_name: str, kind: GGMLQuantizationType, bits: int, cols: slice) -> str:
        """Why a Q8_0/Q4_0 weight's blocks are not kept as they are."""
        if EXACT_BITS[kind] != bits:
            return f"{gguf_name}: {kind.name} fused with int{bits} weights, re-quantized"
        return (
            f"{gguf_name}: this rank's columns {cols.start}:{cols.stop} split blocks of "
            f"{BLOCK}, re-quantized from fp32"
        )

    def served_bits(self, name: str) -> int | None:
        """The bits a linear weight is served at (``precision``): the highest among the
        weights fused with it, None (fp32) if any of them is a float type."""
        # (``name`` itself even when absent: its lookup names what the file lacks)
        kinds = [self.kind(part) for part in fused_with(name) if part == name or part in self]
        bits = [served_bits(kind) for kind in kinds]
        return None if None in bits else max(b for b in bits if b is not None)

    def kind(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self._tensor(name).tensor_type)

    def _exact(
        self,
        name: str,
        kind: GGMLQuantizationType,
        n: int,
        k: int,
        rows: slice | None,
        cols: slice,
    ) -> QuantizedBlocks:
        tensor = self._tensor(name)
        whole = exact_blocks(kind, np.asarray(tensor.data).reshape(n, -1), n, k)
        packed = self._unpermuted(name, whole.packed)
        scales = self._unpermuted(name, whole.scales.reshape(n, -1))
        index = (rows or slice(None), slice(cols.start // BLOCK, cols.stop // BLOCK))
        part = np.ascontiguousarray(scales[index])
        return QuantizedBlocks(
            np.ascontiguousarray(packed[index]),
            part.reshape(-1),
            whole.bits,
            BLOCK,
            k=cols.stop - cols.start,
            n=part.shape[0],
        )

    def _unpermuted(self, name: str, weight: np.ndarray) -> np.ndarray:
        if not self._permuted:
            return weight
        if ".self_attn.q_proj." in name:
            return unpermute_rows(weight, self.config.heads)
        if ".self_attn.k_proj." in name:
            return unpermute_rows(weight, self.config.kv_heads)
        return weight

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)
