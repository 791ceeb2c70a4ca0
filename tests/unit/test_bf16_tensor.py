"""BF16 tensors: the wire bytes match tritonclient's encoding, and onnxruntime takes them."""

from __future__ import annotations

import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from tritonclient.http import InferInput

from shardserve.errors import BadInputError
from shardserve.repo.signature import check_tensor
from shardserve.runtime.program import OrtSegment
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import DATATYPE_TO_DTYPE, Tensor, digest_tensors, is_bfloat16

# All exactly representable in bfloat16, so truncating float32 (the wire rule) and
# rounding to nearest (ml_dtypes) agree.
VALUES = [1.0, -2.5, 0.15625, 2.0**100, -0.0, 100.0]


def upper_halves(values: list[float]) -> bytes:
    """BF16 as tritonclient sends it: the upper 2 bytes of each little-endian float32."""
    return b"".join(struct.pack("<f", v)[2:4] for v in values)


def test_from_numpy_bytes_equal_tritonclients_encoding() -> None:
    array = np.asarray(VALUES, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    tensor = Tensor.from_numpy(array)
    assert (tensor.dtype, tensor.datatype, tensor.shape) == ("bfloat16", "BF16", (2, 3))
    triton = InferInput("x", [2, 3], "BF16")
    triton.set_data_from_numpy(array, binary_data=True)
    assert tensor.data == upper_halves(VALUES) == triton._get_binary_data()


def test_wire_bytes_round_trip_to_numpy_and_back() -> None:
    tensor = Tensor(dtype="bfloat16", shape=(2, 3), data=upper_halves(VALUES))
    array = tensor.to_numpy()
    assert array.dtype == np.dtype(ml_dtypes.bfloat16)
    assert array.shape == (2, 3)
    assert array.astype(np.float32).reshape(-1).tolist()[:3] == [1.0, -2.5, 0.15625]
    assert Tensor.from_numpy(array).data == tensor.data
    assert DATATYPE_TO_DTYPE["BF16"] == tensor.dtype


def test_bfloat16_is_told_from_other_two_byte_and_void_types() -> None:
    assert is_bfloat16(np.dtype(ml_dtypes.bfloat16))
    for other in (np.dtype("V2"), np.dtype(np.float16), np.dtype(np.uint16), np.dtype("<f4")):
        assert not is_bfloat16(other), other
    with pytest.raises(BadInputError, match="unsupported tensor dtype"):
        Tensor.from_numpy(np.zeros(3, dtype="V2"))  # a plain void type is not BF16


def test_wrong_byte_count_is_a_clear_error() -> None:
    tensor = Tensor(dtype="bfloat16", shape=(2, 3), data=b"\x00" * 10)
    with pytest.raises(Exception, match="10 bytes, shape \\[2, 3\\] of BF16 needs 12"):
        tensor.to_numpy()


def test_signature_accepts_bf16_and_names_a_mismatch() -> None:
    spec = TensorSpec(name="x", datatype="BF16", shape=(2, 3))
    check_tensor("x", Tensor(dtype="bfloat16", shape=(2, 3), data=bytes(12)), spec)
    with pytest.raises(Exception, match="has datatype FP16, expected BF16"):
        check_tensor("x", Tensor(dtype="<f2", shape=(2, 3), data=bytes(12)), spec)


def test_digest_tells_bf16_from_fp16_with_the_same_bytes() -> None:
    bf16 = Tensor(dtype="bfloat16", shape=(3,), data=bytes(6))
    fp16 = Tensor(dtype="<f2", shape=(3,), data=bytes(6))
    assert digest_tensors({"x": bf16}) != digest_tensors({"x": fp16})


def bf16_cast_model(path: Path) -> Path:
    """x BFLOAT16 [2, 3] -> Cast to FLOAT -> y FLOAT [2, 3]."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        "bf16_cast",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


async def test_ort_segment_runs_a_bf16_input_from_the_wire(tmp_path: Path) -> None:
    model = bf16_cast_model(tmp_path / "cast.onnx")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    segment = OrtSegment(session, run_in_thread=False)
    x = Tensor(dtype="bfloat16", shape=(2, 3), data=upper_halves(VALUES)).to_numpy()
    y = (await segment.run({"x": x}))["y"]
    assert y.dtype == np.float32
    assert y.tobytes() == x.astype(np.float32).tobytes()
    assert y.reshape(-1)[:3].tolist() == [1.0, -2.5, 0.15625]


def test_a_bf16_model_output_comes_back_as_bfloat16() -> None:
    """onnxruntime cannot return BF16 to numpy; the segment copies its bits out."""
    import ml_dtypes
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from shardserve.runtime.program import OrtSegment
    from shardserve.wire.tensors import Tensor

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)
    graph = helper.make_graph([node], "to_bf16", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = OrtSegment(session, run_in_thread=False).run_sync(
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    )["y"]
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.astype(np.float32), np.arange(6).reshape(2, 3))
    assert Tensor.from_numpy(out).datatype == "BF16"
