"""numpy references for quantized slices: the tiny checkpoints' linear weights replaced by
the dequantized blocks the exporter writes (the same quantizer, per output row along K), and
a matmul that quantizes its activations per block to int8 as onnxruntime's
``accuracy_level`` 4 path does."""

from __future__ import annotations

import numpy as np
from hf_checkpoints import CONFIGS, Weights, default_head

from shardserve.tools.quantize import dequantize, quantize_blocks

# Linear weights by name ending, and whether the checkpoint stores them [K, N] (GPT-2 Conv1D).
_LINEAR = {
    "gpt2": ((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"), True),
    "llama": (("_proj.weight",), False),
}


def _round_trip(weight_nk: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    return dequantize(quantize_blocks(weight_nk, bits, block_size))


def dequantized_weights(
    kind: str, weights: Weights, bits: int, block_size: int
) -> tuple[Weights, np.ndarray]:
    """(weights with every linear layer's dequantized blocks, the dequantized LM head
    [V, H]); embeddings and norms are left fp32."""
    endings, k_major = _LINEAR["gpt2" if kind == "gpt2" else "llama"]
    out = dict(weights)
    for name, value in weights.items():
        if name.endswith(endings):
            nk = value.T if k_major else value
            restored = _round_trip(np.ascontiguousarray(nk), bits, block_size)
            out[name] = restored.T if k_major else restored
    head = _round_trip(default_head(kind, weights), bits, block_size)
    assert kind in CONFIGS
    return out, head


def activation_quantized(x: np.ndarray, block_size: int) -> np.ndarray:
    """``x [M, K]`` as the int8 per-block activations dequantize: scale max|x|/127 per block
    of K, codes rounded half to even (what MLAS computes, measured on exact ties)."""
    m, k = x.shape
    blocks = np.pad(x.astype(np.float32), ((0, 0), (0, -k % block_size))).reshape(m, -1, block_size)
    scale = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    codes = np.where(scale == 0, 0, np.rint(blocks * (np.float32(1) / safe)))
    return (codes * scale).reshape(m, -1)[:, :k]
