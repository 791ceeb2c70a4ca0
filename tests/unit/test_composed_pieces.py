"""Composing a stage piece (segments + attention ops between collectives) into one model:
which ops form pieces, what the model reads and makes, and (real onnxruntime) that the
whole run over a sequence's KV cache and the segment-by-segment run with numpy attention
give the same values and the same cache."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from shardserve.errors import InternalError
from shardserve.repo.repository import AllReduceOp, AttentionOp, RunOp
from shardserve.runtime.attention import StepAttention, StepLayout
from shardserve.runtime.compose import compose_piece, piece_spans
from shardserve.runtime.kv_cache import CacheShape, KVCache
from shardserve.runtime.light_model import graph_inputs, light_model
from shardserve.runtime.pieces import EXTERNAL_FOLDER_KEY, Piece

HQ, HKV, D = 4, 2, 8
ATTENTION = AttentionOp(layer=3, q="q", k="k", v="v", output="attn")
OPS = (RunOp(file="s0.onnx"), ATTENTION, RunOp(file="s1.onnx"))


def _model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "segment", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _info(name: str, *dims: int | str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))


def segments() -> dict[str, onnx.ModelProto]:
    """s0: x [N, HQ*D] -> q, k, v (weights inside); s1: attn + x -> y."""
    rng = np.random.default_rng(7)
    wq, wkv = (rng.standard_normal((HQ * D, n * D), dtype=np.float32) for n in (HQ, 2 * HKV))
    s0 = _model(
        [
            helper.make_node("MatMul", ["x", "wq"], ["q2"]),
            helper.make_node("Reshape", ["q2", "q_shape"], ["q"]),
            helper.make_node("MatMul", ["x", "wkv"], ["kv2"]),
            helper.make_node("Reshape", ["kv2", "kv_shape"], ["kv"]),
            helper.make_node("Split", ["kv"], ["k", "v"], axis=1, num_outputs=2),
        ],
        [_info("x", "tokens", HQ * D)],
        [_info("q", "tokens", HQ, D), _info("k", "tokens", HKV, D), _info("v", "tokens", HKV, D)],
        [
            onnx.numpy_helper.from_array(wq, "wq"),
            onnx.numpy_helper.from_array(wkv, "wkv"),
            onnx.numpy_helper.from_array(np.array([-1, HQ, D], np.int64), "q_shape"),
            onnx.numpy_helper.from_array(np.array([-1, 2 * HKV, D], np.int64), "kv_shape"),
        ],
    )
    s0.opset_import[0].version = 18  # Split's num_outputs
    s1 = _model(
        [helper.make_node("Add", ["attn", "x"], ["y"])],
        [_info("attn", "tokens", HQ * D), _info("x", "tokens", HQ * D)],
        [_info("y", "tokens", HQ * D)],
    )
    return {"s0.onnx": s0, "s1.onnx": s1}


def test_pieces_are_the_runs_between_collectives_that_attend() -> None:
    reduce = AllReduceOp(input="a", output="b")
    program = [*OPS, reduce, RunOp(file="m.onnx"), reduce, RunOp(file="s2.onnx"), ATTENTION]
    assert piece_spans(program) == [(0, 3), (6, 8)]
    assert piece_spans([RunOp(file="m.onnx"), reduce]) == []


def test_the_model_reads_the_environment_and_makes_what_is_read_after() -> None:
    composed = compose_piece(OPS, segments(), read_after={"y"})
    assert composed.inputs == ("x",)
    assert composed.outputs == ("y",)
    assert composed.layers == (3,)
    assert composed.segment_inputs == {"s0.onnx": ("x",), "s1.onnx": ("attn", "x")}
    kinds = [node.op_type for node in composed.model.graph.node]
    assert kinds == ["If", "If", "If"]  # segment, attention, segment
    outputs = {value.name for value in composed.model.graph.output}
    assert {"present_key.3", "present_value.3", "y"} <= outputs


def test_a_segment_with_a_subgraph_is_refused() -> None:
    models = segments()
    branch = helper.make_graph([], "b", [], [])
    node = helper.make_node("If", ["c"], [], then_branch=branch, else_branch=branch)
    models["s1.onnx"].graph.node.append(node)
    with pytest.raises(InternalError, match="holds a subgraph"):
        compose_piece(OPS, models, read_after={"y"})


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@dataclass
class _Rig:
    """A composed piece beside the original segments, each over a KV cache of its own."""

    piece: Piece
    originals: dict[str, ort.InferenceSession]
    fused_cache: KVCache
    numpy_cache: KVCache

    def step(
        self, seq: int, start: int, x: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step of ``seq`` both ways: the whole run's y, the numpy path's y and its
        attention output."""
        layout = StepLayout([(seq, start, len(x))])
        sole = StepAttention(self.fused_cache, layout).sole_sequence()
        assert sole is not None
        whole = asyncio.run(self.piece.whole.run(self.piece.feeds({"x": x}, sole)))
        q, k, v = self.originals["s0.onnx"].run(None, {"x": x})
        attn = StepAttention(self.numpy_cache, layout).attend(3, q, k, v)
        [y] = self.originals["s1.onnx"].run(None, {"attn": attn, "x": x})
        return whole["y"], y, attn


def _rig(*sequences: int) -> _Rig:
    models = segments()
    composed = compose_piece(OPS, models, read_after={"y"})
    piece = Piece(0, 3, composed, _session(composed.model), run_in_thread=False)
    originals = {name: _session(model) for name, model in models.items()}
    shape = CacheShape((3,), HKV, D)
    rig = _Rig(piece, originals, KVCache(shape, 1 << 20), KVCache(shape, 1 << 20))
    for cache in (rig.fused_cache, rig.numpy_cache):
        for seq in sequences:
            cache.reserve(seq, 16)
    return rig


def test_whole_runs_equal_segment_runs_with_numpy_attention() -> None:
    """A 5-token prompt, then a 3-token chunk, then one decode token: values and K/V."""
    rig = _rig(1)
    rng = np.random.default_rng(0)
    for start, count in ((0, 5), (5, 3), (8, 1)):
        x = rng.standard_normal((count, HQ * D), dtype=np.float32)
        whole, y, attn = rig.step(1, start, x)
        np.testing.assert_allclose(whole, y, atol=1e-5)
        np.testing.assert_array_equal(rig.fused_cache.layer(1, 3), rig.numpy_cache.layer(1, 3))
        q, _, _ = rig.originals["s0.onnx"].run(None, {"x": x})
        by_segment = asyncio.run(rig.piece.segment("s0.onnx").run({"x": x}))
        np.testing.assert_array_equal(by_segment["q"], q)
        again = asyncio.run(rig.piece.segment("s1.onnx").run({"attn": attn, "x": x}))
        np.testing.assert_array_equal(again["y"], y)


def test_interleaved_sequences_each_run_over_their_own_cache() -> None:
    """Whole runs keep their binding while a sequence steps on; another sequence's step
    (other cache memory) in between must bind its own K/V, and the first's next step its
    own again: every value and cache row equals the numpy path's."""
    rig = _rig(1, 2)
    rng = np.random.default_rng(1)
    steps = ((1, 0, 4), (2, 0, 6), (1, 4, 1), (1, 5, 1), (2, 6, 1), (1, 6, 1), (2, 7, 2))
    for seq, start, count in steps:
        x = rng.standard_normal((count, HQ * D), dtype=np.float32)
        whole, y, _ = rig.step(seq, start, x)
        np.testing.assert_allclose(whole, y, atol=1e-5)
        for other in (1, 2):
            np.testing.assert_array_equal(
                rig.fused_cache.layer(other, 3), rig.numpy_cache.layer(other, 3)
            )


def test_packing_several_sequences_has_no_sole_sequence() -> None:
    cache = KVCache(CacheShape((0,), HKV, D), 1 << 20)
    cache.reserve(1, 4)
    cache.reserve(2, 4)
    assert StepAttention(cache, StepLayout([(1, 0, 2), (2, 0, 1)])).sole_sequence() is None


def test_a_light_model_points_at_its_weights_in_the_file(tmp_path: Path) -> None:
    """Read without its weights' bytes, a segment runs the same from its file's folder."""
    model = segments()["s0.onnx"]
    path = tmp_path / "s0.onnx"
    path.write_bytes(model.SerializeToString())
    light = light_model(path)
    big = {t.name for t in light.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert big == {"wq", "wkv"}  # the shapes stay inline
    assert len(light.SerializeToString()) < 1000 < path.stat().st_size
    assert graph_inputs(path) == ("x",)
    options = ort.SessionOptions()
    options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(tmp_path))
    light_session = ort.InferenceSession(light.SerializeToString(), options)
    x = np.random.default_rng(1).standard_normal((3, HQ * D), dtype=np.float32)
    for got, want in zip(
        light_session.run(None, {"x": x}), _session(model).run(None, {"x": x}), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_a_segment_run_feeds_only_what_the_segment_reads() -> None:
    """Every input has a default (flags false), the attention sits in an If on ``fused``:
    segment s1 runs on its own reads and its flag, and no GroupQueryAttention runs."""
    composed = compose_piece(OPS, segments(), read_after={"y"})
    graph = composed.model.graph
    assert {value.name for value in graph.input} <= {t.name for t in graph.initializer}
    [attention] = [node for node in graph.node if node.name == "attention3"]
    assert list(attention.input) == ["fused"]
    session = _session(composed.model)
    rng = np.random.default_rng(2)
    attn, x = (rng.standard_normal((3, HQ * D), dtype=np.float32) for _ in range(2))
    [y] = session.run(["y"], {"attn@in": attn, "x": x, "run.1": np.array(True)})
    np.testing.assert_array_equal(y, attn + x)
