"""GGUF Q4_0/Q8_0 bytes re-laid as MatMulNBits blocks: the values MatMulNBits multiplies
equal gguf's own dequantization bit for bit (no second rounding)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from shardserve.errors import ExportError
from shardserve.tools.export.gguf.blocks import exact_blocks

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(("kind", "bits"), [(Q.Q4_0, 4), (Q.Q8_0, 8)])
def test_blocks_dequantize_exactly_as_gguf(kind: gguf.GGMLQuantizationType, bits: int) -> None:
    weight = np.random.default_rng(3).normal(0, 0.05, (6, 96)).astype(np.float32)
    data = gguf.quantize(weight, kind)
    blocks = exact_blocks(kind, data, 6, 96)
    assert blocks.bits == bits
    assert blocks.packed.shape == (6, 3, 32 * bits // 8)
    assert blocks.scales.shape == (18,)
    expected = gguf.dequantize(data, kind).astype(np.float32)
    np.testing.assert_array_equal(blocks.dequantized(), expected)


def test_nibbles_are_in_matmul_nbits_order() -> None:
    """A Q4_0 block of codes 0..15, 0..15: element 2i is the low nibble of byte i."""
    q = np.concatenate([np.arange(16), np.arange(16)]).astype(np.uint8)
    block = np.concatenate(
        [np.array([1.0], np.float16).view(np.uint8), (q[:16] | (q[16:] << 4)).astype(np.uint8)]
    )
    blocks = exact_blocks(Q.Q4_0, block.reshape(1, 18), 1, 32)
    assert blocks.packed[0, 0, 0] == (0 | 1 << 4)
    assert blocks.packed[0, 0, 8] == (0 | 1 << 4)  # element 16 (q=0) and 17 (q=1)
    np.testing.assert_array_equal(blocks.dequantized()[0], q.astype(np.float32) - 8)


def test_other_types_and_partial_blocks_are_refused() -> None:
    data = gguf.quantize(np.ones((2, 32), np.float32), Q.Q4_1)
    with pytest.raises(ExportError, match="Q4_1 has no exact MatMulNBits form"):
        exact_blocks(Q.Q4_1, data, 2, 32)
    with pytest.raises(ExportError, match="not whole blocks of 32"):
        exact_blocks(Q.Q8_0, np.zeros((1, 34), np.uint8), 1, 40)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0])
def test_onnxruntime_matmul_nbits_multiplies_by_the_gguf_weights(
    kind: gguf.GGMLQuantizationType,
) -> None:
    """The blocks fed to a real MatMulNBits (accuracy level 0: fp32 activations) give
    x @ W.T for W = gguf's dequantization."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = 8, 64
    rng = np.random.default_rng(5)
    data = gguf.quantize(rng.normal(0, 0.05, (n, k)).astype(np.float32), kind)
    blocks = exact_blocks(kind, data, n, k)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "codes", "scales"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=blocks.bits,
        block_size=32,
        accuracy_level=0,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        [
            numpy_helper.from_array(blocks.packed, "codes"),
            numpy_helper.from_array(blocks.scales, "scales"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(0, 1, (3, k)).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    weight = gguf.dequantize(data, kind).astype(np.float32)
    np.testing.assert_allclose(got, x @ weight.T, rtol=1e-5, atol=1e-6)
