"""The quantization pass over one ONNX segment: every linear layer whose weight is a
constant 2-D float initializer (``MatMul(x, W)``, ``Gemm(x, W[, bias])`` with
``alpha = beta = 1`` and ``transA = 0``) becomes a ``MatMulNBits``; everything else
(embedding ``Gather``s, norms, activations, the KV cache outside the graph) stays fp32.

Run per rank after slicing, so each rank quantizes only the weights it holds and a block
never straddles two ranks' parts. A weight the source held quantized already (a GGUF
file's Q8_0/Q4_0 blocks, sliced for the rank) is given in ``kept``: when its blocks have the
format the spec asks for that weight, they are used as they are (no second rounding).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shardserve.errors import ExportError
from shardserve.tools.quantize.blocks import QuantizedBlocks, check_block_size, quantize_blocks
from shardserve.tools.quantize.nodes import (
    ACCURACY_LEVELS,
    DEFAULT_ACCURACY_LEVEL,
    MS_DOMAIN,
    NBitsMatMul,
    matmul_nbits,
)

__all__ = [
    "AS_SOURCE",
    "FP32",
    "PRECISIONS",
    "QuantizeSpec",
    "quantize_model",
    "quantize_segments",
    "quantized_origin",
]

PRECISIONS = {"int8": 8, "int4": 4, "int4-mixed": 4}
# int4-mixed: the MLP's down projection and the LM head (the Hugging Face exporter's
# ``mlp_out`` and ``lm_head`` weights, whose 4-bit error costs the most perplexity) at 8 bits
# in blocks of 32 (SmolLM2-135M: perplexity ratio 1.228 instead of int4's 1.447).
MIXED_8BIT_PREFIXES = ("mlp_out.", "lm_head")
MIXED_8BIT_BLOCK = 32
# Weights per block when --block-size is not given, by bits. 4 bits: 32, GGUF's Q4_0 (the
# 4-bit error grows with the block). 8 bits: 128. onnxruntime's 8-bit MatMulNBits streams its
# weights faster in blocks of 128 than of 32 (a 125 M model's one-sequence step 17-20 %
# faster; the 768x32000 head at one row 0.61 vs 0.78 ms; no change at 32 rows), and 8-bit
# blocks of 128 cost no measurable quality (SmolLM2-135M perplexity ratio 1.0070 against
# 1.0081 at 32): docs/performance.md.
DEFAULT_BLOCK_SIZES = {8: 128, 4: 32}
# Each linear weight at the format of the blocks its source hands out (``kept``), fp32
# where it hands out none: a GGUF file's own types (shardserve.tools.export.gguf.precision).
AS_SOURCE = "source"
# No quantization (the default of every exporter but GGUF's, which serves a file's own types).
FP32 = "fp32"


def block_size_for(bits: int, block_size: int | None) -> int:
    """The block size a weight of ``bits`` is rounded to (None: the bits' default)."""
    return block_size or DEFAULT_BLOCK_SIZES[bits]


@dataclass(frozen=True)
class QuantizeSpec:
    """How a slice's linear layers are quantized (``--quantize``, ``--block-size``,
    ``--accuracy-level``)."""

    precision: str
    # None: the bits' default (DEFAULT_BLOCK_SIZES), or a source's own blocks of those bits
    block_size: int | None = None
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL

    def __post_init__(self) -> None:
        if self.precision not in (*PRECISIONS, AS_SOURCE, FP32):
            raise ExportError(
                f"quantize precision must be one of {sorted([*PRECISIONS, FP32])}, "
                f"got {self.precision!r}"
            )
        if self.precision in PRECISIONS and self.block_size is not None:
            check_block_size(self.bits, self.block_size)
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ExportError(
                f"accuracy level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level}"
            )

    @property
    def bits(self) -> int:
        return PRECISIONS[self.precision]

    def format_for(self, weight_name: str) -> tuple[int, int | None] | None:
        """(bits, block size) of one weight (block None: the bits' default, or the source's
        own blocks of those bits); None: as its source's blocks (AS_SOURCE), or fp32."""
        if self.precision not in PRECISIONS:
            return None
        if self.precision == "int4-mixed" and weight_name.startswith(MIXED_8BIT_PREFIXES):
            return 8, MIXED_8BIT_BLOCK
        return self.bits, self.block_size

    def origin(self) -> dict[str, str | int]:
        """What group.json's ``origin`` records: the precision is part of the slice."""
        if self.precision == FP32:
            return {}
        return {
            "quantize": self.precision,
            "quantize_block_size": "default" if self.block_size is None else self.block_size,
            "quantize_accuracy_level": self.accuracy_level,
        }


def quantize_model(
    model: onnx.ModelProto,
    spec: QuantizeSpec,
    kept: Mapping[str, QuantizedBlocks] | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with its constant-weight linear layers as ``MatMulNBits``
    (``kept``: blocks made at the source, by weight initializer name)."""
    if spec.precision == FP32:
        return model
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    consumed: set[str] = set()
    for node in graph.node:
        replacement = _replace(node, weights, spec, kept or {})
        if replacement is None:
            nodes.append(node)
            continue
        nodes.append(replacement.node)
        added.extend(replacement.initializers)
        consumed.update(n for n in node.input[1:] if n)
    if not added:
        return model
    remaining = [t for t in graph.initializer if t.name not in consumed or uses[t.name] > 1]
    return _rebuilt(model, nodes, [*remaining, *added])


def _replace(
    node: onnx.NodeProto,
    weights: dict[str, onnx.TensorProto],
    spec: QuantizeSpec,
    kept: Mapping[str, QuantizedBlocks],
) -> NBitsMatMul | None:
    linear = _linear(node, weights)
    if linear is None:
        return None
    weight_nk, bias = linear
    name = node.input[1]
    blocks = _chosen_blocks(name, weight_nk, kept.get(name), spec.format_for(name))
    if blocks is None:
        return None  # as its source: fp32
    return matmul_nbits(
        name,
        blocks,
        activation=node.input[0],
        output=node.output[0],
        accuracy_level=spec.accuracy_level,
        bias=bias,
        node_name=node.name or None,
    )


def _chosen_blocks(
    name: str,
    weight_nk: np.ndarray,
    blocks: QuantizedBlocks | None,
    wanted: tuple[int, int | None] | None,
) -> QuantizedBlocks | None:
    """The source's blocks when they have the wanted bits and block size (any size when
    that is None), or any with ``wanted`` None; else the weight rounded to ``wanted`` (the
    bits' default block size when None); None: no blocks, stays fp32."""
    if wanted is not None:
        bits, block = wanted
        if blocks is None or blocks.bits != bits or block not in (None, blocks.block_size):
            return quantize_blocks(weight_nk, bits, block_size_for(bits, block))
    if blocks is not None and (blocks.n, blocks.k) != weight_nk.shape:
        raise ExportError(
            f"kept blocks of {name!r} are [{blocks.n}, {blocks.k}], "
            f"its weight is {list(weight_nk.shape)}"
        )
    return blocks


def _linear(
    node: onnx.NodeProto, weights: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``(W [N, K], bias [N] or None)`` of a linear node with constant weights, else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    weight = _float_matrix(weights.get(node.input[1]))
    if weight is None:
        return None
    if node.op_type == "MatMul":
        return np.ascontiguousarray(weight.T), None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA"):
        return None
    weight_nk = weight if attrs.get("transB") else np.ascontiguousarray(weight.T)
    if len(node.input) < 3 or not node.input[2]:
        return weight_nk, None
    bias = weights.get(node.input[2])
    if bias is None or tuple(bias.dims) != (weight_nk.shape[0],):
        return None  # a broadcast or computed bias: leave the node as it is
    return weight_nk, numpy_helper.to_array(bias).astype(np.float32)


def _float_matrix(tensor: onnx.TensorProto | None) -> np.ndarray | None:
    if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
        return None
    if tensor.data_location == TensorProto.EXTERNAL:
        raise ExportError(
            f"weight {tensor.name!r} is in an external data file: load it into the model first"
        )
    return numpy_helper.to_array(tensor)


def _rebuilt(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto]
) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(initializers)
    if not any(o.domain == MS_DOMAIN for o in copy.opset_import):
        copy.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return copy


def quantize_segments(
    segments: Mapping[str, onnx.ModelProto], spec: QuantizeSpec | None
) -> dict[str, onnx.ModelProto]:
    """A rank's segments (file name -> model) quantized by ``spec`` (as they are if None)."""
    if spec is None:
        return dict(segments)
    return {name: quantize_model(model, spec) for name, model in segments.items()}


def quantized_origin(
    origin: Mapping[str, str | int | float | bool], spec: QuantizeSpec | None
) -> dict[str, str | int | float | bool]:
    """group.json's ``origin`` with the precision recorded (unchanged for fp32)."""
    return {**origin, **(spec.origin() if spec is not None else {})}
