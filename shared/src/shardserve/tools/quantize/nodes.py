"""A ``com.microsoft`` ``MatMulNBits`` node and its initializers from quantized blocks.

Separate from the rounding on purpose: a caller holding blocks that are already quantized
(GGUF Q8_0/Q4_0 import) builds the node from them as they are, without re-rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from shardserve.tools.onnx_graph import MS_DOMAIN
from shardserve.tools.quantize.blocks import QuantizedBlocks

__all__ = ["MS_DOMAIN", "NBitsMatMul", "matmul_nbits"]

# accuracy_level 4: activations quantized to int8 per block (the fast path on x86);
# 0: activations stay fp32 and the weights are dequantized (the exact path).
DEFAULT_ACCURACY_LEVEL = 4
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class NBitsMatMul:
    """The node and the initializers it reads (packed codes, scales, bias if any)."""

    node: onnx.NodeProto
    initializers: tuple[onnx.TensorProto, ...]


def matmul_nbits(
    weight_name: str,
    blocks: QuantizedBlocks,
    *,
    activation: str,
    output: str,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    bias: np.ndarray | None = None,
    node_name: str | None = None,
) -> NBitsMatMul:
    """``output = activation @ W.T (+ bias)`` for the ``[N, K]`` weight ``blocks`` hold.

    Initializers are named ``<weight_name>.q<bits>`` (codes), ``<weight_name>.scales`` and
    ``<weight_name>.bias``; the default zero point ``2**(bits-1)`` applies (symmetric)."""
    codes = f"{weight_name}.q{blocks.bits}"
    scales = f"{weight_name}.scales"
    tensors = [
        numpy_helper.from_array(blocks.packed, codes),
        numpy_helper.from_array(blocks.scales, scales),
    ]
    inputs = [activation, codes, scales]
    if bias is not None:
        inputs += ["", "", f"{weight_name}.bias"]  # no zero_points, no g_idx
        tensors.append(numpy_helper.from_array(np.asarray(bias, np.float32), inputs[-1]))
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        [output],
        node_name or f"MatMulNBits_{weight_name}",
        domain=MS_DOMAIN,
        K=blocks.k,
        N=blocks.n,
        bits=blocks.bits,
        block_size=blocks.block_size,
        accuracy_level=accuracy_level,
    )
    return NBitsMatMul(node, tuple(tensors))
