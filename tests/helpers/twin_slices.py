"""A one-rank servable of two MatMul segments (h = x @ W, y = h @ W'), for the tests of
shared weights: W' is W unless asked otherwise. Used by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shardserve.repo.repository import RunOp
from shardserve.tools.slicing import RankSlice, SliceLayout, write_slices
from shardserve.wire.protocol import TensorSpec

SIZE = 256  # a SIZE x SIZE float32 weight is 256 KiB, above segments.MIN_SHARED_BYTES


def matmul_segment(
    inputs: str, output: str, weight: np.ndarray, name: str = "W"
) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", [inputs, name], [output])],
        output,
        [helper.make_tensor_value_info(inputs, TensorProto.FLOAT, [4, weight.shape[0]])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [4, weight.shape[1]])],
        [numpy_helper.from_array(weight, name)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def weight(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((SIZE, SIZE)) / SIZE).astype(np.float32)


def write_two_segments(out: Path, name: str, second_seed: int = 0) -> Path:
    """One rank, two segments (h = x @ W, y = h @ W'); W' is W when ``second_seed`` is 0."""
    spec = {n: TensorSpec(name=n, datatype="FP32", shape=(4, SIZE)) for n in ("x", "y")}
    layout = SliceLayout(
        servable=name,
        version=1,
        rank_size=1,
        stage_size=1,
        inputs=(spec["x"],),
        outputs=(spec["y"],),
        stage_io=((("x",), ("y",)),),
    )
    program = (RunOp(file="first.onnx"), RunOp(file="second.onnx"))
    segments = {
        "first.onnx": matmul_segment("x", "h", weight(0)),
        "second.onnx": matmul_segment("h", "y", weight(second_seed)),
    }
    write_slices(out, layout, lambda rank: RankSlice(program, segments))
    return out
