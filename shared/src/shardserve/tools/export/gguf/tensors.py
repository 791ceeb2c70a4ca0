"""A GGUF file's tensors under Hugging Face names, as fp32.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``), stores shapes
fastest-dimension first, and for the ``llama`` architecture permutes the rows of the Q and
K projections so that its rotary kernel sees each head's pairs side by side; this undoes
that (exactly as transformers' GGUF loader does) so that the Hugging Face graph's
``rotate_half`` rotary applies. Quantized types are dequantized with the ``gguf`` package;
Q8_0 and Q4_0 linear weights can also be handed out as their blocks, exactly (``blocks``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, dequantize

from shardserve.errors import ExportError
from shardserve.tools.export.gguf.blocks import BLOCK, EXACT_BITS, exact_blocks
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.quantize import QuantizedBlocks

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
    ) -> None:
        """``keep_blocks``: hand out Q8_0/Q4_0 blocks (an export that quantizes keeps them)."""
        self.file, self.config, self.keep_blocks = file, config, keep_blocks
        self._permuted = file.get("general.architecture") == "llama"
        self._progress = progress
        self._seen: set[str] = set()

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
        self._note(kind)
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
        """``name[rows, cols]`` as the file's own Q8_0/Q4_0 blocks (no rounding), or None when
        it is another type or ``cols`` (a K split) does not fall on 32-value block bounds."""
        if not self.keep_blocks:
            return None
        tensor = self._tensor(name)
        kind = GGMLQuantizationType(tensor.tensor_type)
        n, k = (int(d) for d in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        cols = cols or slice(0, k)
        if kind not in EXACT_BITS or not n:
            return None
        if cols.start % BLOCK or cols.stop % BLOCK:
            self._say(
                f"{tensor.name}: this rank's columns {cols.start}:{cols.stop} split blocks of "
                f"{BLOCK}, re-quantized from fp32"
            )
            return None
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

    def _note(self, kind: GGMLQuantizationType) -> None:
        if kind.name not in self._seen and kind != GGMLQuantizationType.F32:
            self._seen.add(kind.name)
            self._say(f"dequantized {kind.name} -> fp32")

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)
