"""Weight-only block-wise quantization of slices (``--quantize int8|int4``): the blocks
(``blocks``), the ``MatMulNBits`` node built from them (``nodes``) and the pass over a
segment (``graph``)."""

from shardserve.tools.quantize.blocks import QuantizedBlocks, dequantize, quantize_blocks
from shardserve.tools.quantize.graph import (
    AS_SOURCE,
    DEFAULT_BLOCK_SIZES,
    FP32,
    PRECISIONS,
    QuantizeSpec,
    block_size_for,
    quantize_model,
    quantize_segments,
    quantized_origin,
)
from shardserve.tools.quantize.nodes import DEFAULT_ACCURACY_LEVEL, NBitsMatMul, matmul_nbits

__all__ = [
    "AS_SOURCE",
    "DEFAULT_ACCURACY_LEVEL",
    "DEFAULT_BLOCK_SIZES",
    "FP32",
    "PRECISIONS",
    "NBitsMatMul",
    "QuantizeSpec",
    "QuantizedBlocks",
    "block_size_for",
    "dequantize",
    "matmul_nbits",
    "quantize_blocks",
    "quantize_model",
    "quantize_segments",
    "quantized_origin",
]
