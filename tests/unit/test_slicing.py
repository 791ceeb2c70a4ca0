"""Generic slicing of ONNX models built here with onnx.helper (not by our exporters):
pipeline cuts, automatic balancing, tensor parallel, external data, refusals."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardserve.errors import ExportError, UnsafePathError
from shardserve.repo.repository import AllGatherOp, AllReduceOp, GroupConfig
from shardserve.runtime.program import run_group_locally
from shardserve.tools.slicing import check_external_data, slice_pipeline, tensor_parallel

RNG = np.random.default_rng(11)


def _init(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.3).astype(np.float32), name)


def _save(tmp_path: Path, graph: onnx.GraphProto, name: str = "model") -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _fp(name: str, *shape: int | str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _rich_graph() -> onnx.GraphProto:
    """Two inputs, two outputs, a residual t1 -> y skipping the middle, a weight W shared by
    the first and the last MatMul, and input z read only at the end."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m1"], "mm1"),
        helper.make_node("Relu", ["m1"], ["t1"], "relu"),
        helper.make_node("MatMul", ["t1", "W2"], ["m2"], "mm2"),
        helper.make_node("Tanh", ["m2"], ["t2"], "tanh"),
        helper.make_node("Sigmoid", ["t1"], ["early"], "early"),
        helper.make_node("MatMul", ["t2", "W"], ["m3"], "mm3"),
        helper.make_node("Add", ["m3", "t1"], ["t3"], "residual"),
        helper.make_node("Mul", ["t3", "z"], ["y"], "gate"),
    ]
    return helper.make_graph(
        nodes,
        "rich",
        [_fp("x", "batch", 8), _fp("z", "batch", 8)],
        [_fp("y", "batch", 8), _fp("early", "batch", 8)],
        initializer=[_init("W", 8, 8), _init("W2", 8, 8)],
    )


def _run_original(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _run_sliced(
    repo: Path, group: GroupConfig, feeds: dict[str, np.ndarray]
) -> list[dict[str, np.ndarray]]:
    return asyncio.run(run_group_locally(repo, group, feeds))


def _assert_equal_to_original(
    path: Path, repo: Path, group: GroupConfig, feeds: dict[str, np.ndarray]
) -> None:
    want = _run_original(path, feeds)
    results = _run_sliced(repo, group, feeds)
    for got in results:
        assert set(got) == set(want)
        for name in want:
            assert np.abs(got[name] - want[name]).max() <= 1e-5, name
    for got in results[1:]:
        assert all(np.array_equal(got[n], results[0][n]) for n in want)


def _feeds(*names: str, batch: int = 3, width: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {n: rng.standard_normal((batch, width)).astype(np.float32) for n in names}


# ---------------------------------------------------------------- pipeline cuts


def test_cuts_carry_residual_shared_weight_and_late_input(tmp_path: Path) -> None:
    path = _save(tmp_path, _rich_graph())
    group = slice_pipeline(path, tmp_path / "repo", stages=3, cuts=["t1", "t2"])
    s0, s1, s2 = group.stages
    assert s0.inputs == ("x", "z")
    assert set(s0.outputs) == {"t1", "z"}
    assert set(s1.inputs) == set(s0.outputs)
    assert set(s1.outputs) == {"t1", "t2", "z"}  # t1 and z pass through stage 1
    assert s2.outputs == ("y", "early")
    assert group.rank_size == group.stage_size == 3 and group.with_batch_dim
    rank0 = onnx.load(str(tmp_path / "repo/model/1/rank_0/segment0.onnx"))
    rank2 = onnx.load(str(tmp_path / "repo/model/1/rank_2/segment0.onnx"))
    assert "W" in {t.name for t in rank0.graph.initializer}
    assert {t.name for t in rank2.graph.initializer} == {"W"}  # copied, not carried
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x", "z"))


def test_automatic_balance_splits_equal_layers_evenly(tmp_path: Path) -> None:
    nodes, inits, prev = [], [], "x"
    for i in range(6):
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"], f"relu{i}"))
        inits.append(_init(f"W{i}", 16, 16))
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes, "chain", [_fp("x", "batch", 16)], [_fp(prev, "batch", 16)], initializer=inits
    )
    path = _save(tmp_path, graph)
    group = slice_pipeline(path, tmp_path / "repo", stages=3)
    for rank in range(3):
        model = onnx.load(str(tmp_path / f"repo/model/1/rank_{rank}/segment0.onnx"))
        assert [n.op_type for n in model.graph.node].count("MatMul") == 2
        assert len(model.graph.initializer) == 2
    assert group.stages[0].outputs == ("h1",)
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x", width=16))


def test_automatic_balance_on_rich_graph(tmp_path: Path) -> None:
    path = _save(tmp_path, _rich_graph())
    group = slice_pipeline(path, tmp_path / "repo", stages=2)
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x", "z"))


def test_constant_nodes_are_copied_not_carried(tmp_path: Path) -> None:
    const = helper.make_node(
        "Constant", [], ["c"], "const", value=numpy_helper.from_array(np.full(8, 0.5, np.float32))
    )
    nodes = [
        const,
        helper.make_node("Mul", ["x", "c"], ["a"], "mul"),
        helper.make_node("Tanh", ["a"], ["b"], "tanh"),
        helper.make_node("Add", ["b", "c"], ["y"], "add"),
    ]
    graph = helper.make_graph(nodes, "const", [_fp("x", "batch", 8)], [_fp("y", "batch", 8)])
    path = _save(tmp_path, graph)
    group = slice_pipeline(path, tmp_path / "repo", stages=2, cuts=["a"])
    assert group.stages[0].outputs == ("a",)
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x"))


@pytest.mark.parametrize(
    ("cuts", "fragment"),
    [
        (["nope", "t2"], "cut tensor 'nope' is not in the graph"),
        (["x", "t2"], "cut tensor 'x' is a graph input or initializer"),
        (["t2", "t1"], "cut 't1' does not depend on the previous cut 't2'"),
        (["early", "t2"], "cut 't2' does not depend on the previous cut 'early'"),
        (["t1", "t1"], "cut 't1' does not depend on the previous cut 't1'"),
        (["t1"], "1 cut\\(s\\) make 2 stages, but stages=3"),
    ],
)
def test_cut_refusals(tmp_path: Path, cuts: list[str], fragment: str) -> None:
    path = _save(tmp_path, _rich_graph())
    with pytest.raises(ExportError, match=fragment):
        slice_pipeline(path, tmp_path / "repo", stages=3, cuts=cuts)
    assert not (tmp_path / "repo" / "model" / "1").exists()


def test_cut_leaving_an_empty_last_stage_refused(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Tanh", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "two", [_fp("x", 2)], [_fp("y", 2)])
    with pytest.raises(ExportError, match="nothing is left after the last cut 'y'"):
        slice_pipeline(_save(tmp_path, graph), tmp_path / "repo", stages=2, cuts=["y"])


def test_graph_output_made_early_is_carried(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["early"]),
        helper.make_node("Tanh", ["early"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "early", [_fp("x", 2)], [_fp("y", 2), _fp("early", 2)])
    path = _save(tmp_path, graph)
    group = slice_pipeline(path, tmp_path / "repo", stages=3, cuts=["early", "a"])
    assert group.stages[1].outputs == ("early", "a")
    feeds = {"x": np.array([-1.0, 2.0], np.float32)}
    _assert_equal_to_original(path, tmp_path / "repo", group, feeds)


def test_more_stages_than_nodes_refused(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "tiny", [_fp("x", 2)], [_fp("y", 2)]
    )
    with pytest.raises(ExportError, match="cannot fill 2 stages"):
        slice_pipeline(_save(tmp_path, graph), tmp_path / "repo", stages=2)


# ---------------------------------------------------------------- tensor parallel


def _mlp_graph(gemm: bool = False) -> onnx.GraphProto:
    """x -> fc (+bias) -> GELU (Erf form) -> proj (+bias) -> y, and x -> lone MatMul -> side."""
    scalars = [
        numpy_helper.from_array(np.array(v, np.float32), n)
        for n, v in (("inv_sqrt2", 1 / math.sqrt(2)), ("one", 1.0), ("half", 0.5))
    ]
    if gemm:
        first = [helper.make_node("Gemm", ["x", "W1t", "b1"], ["fc"], "fc", transB=1)]
        last = [helper.make_node("Gemm", ["g", "W2", "b2"], ["y"], "proj", beta=0.5)]
        weights = [_init("W1t", 32, 16), _init("b1", 32), _init("W2", 32, 16), _init("b2", 16)]
    else:
        first = [
            helper.make_node("MatMul", ["x", "W1"], ["m1"], "fc"),
            helper.make_node("Add", ["m1", "b1"], ["fc"], "fc_bias"),
        ]
        last = [
            helper.make_node("MatMul", ["g", "W2"], ["m2"], "proj"),
            helper.make_node("Add", ["m2", "b2"], ["y"], "proj_bias"),
        ]
        weights = [_init("W1", 16, 32), _init("b1", 32), _init("W2", 32, 16), _init("b2", 16)]
    gelu = [
        helper.make_node("Mul", ["fc", "inv_sqrt2"], ["s"], "gelu_scale"),
        helper.make_node("Erf", ["s"], ["e"], "gelu_erf"),
        helper.make_node("Add", ["e", "one"], ["e1"], "gelu_add"),
        helper.make_node("Mul", ["fc", "e1"], ["p"], "gelu_mul"),
        helper.make_node("Mul", ["p", "half"], ["g"], "gelu_half"),
    ]
    side = [helper.make_node("MatMul", ["y", "W3"], ["side"], "lone")]
    return helper.make_graph(
        [*first, *gelu, *last, *side],
        "mlp",
        [_fp("x", "batch", 16)],
        [_fp("y", "batch", 16), _fp("side", "batch", 8)],
        initializer=[*weights, _init("W3", 16, 8), *scalars],
    )


@pytest.mark.parametrize(
    ("ranks", "stages", "gemm"), [(2, 1, False), (4, 1, False), (2, 1, True), (2, 2, False)]
)
def test_tensor_parallel_mlp_equals_original(
    tmp_path: Path, ranks: int, stages: int, gemm: bool
) -> None:
    path = _save(tmp_path, _mlp_graph(gemm))
    cuts = ["g"] if stages == 2 else None
    group, report = tensor_parallel(path, tmp_path / "repo", ranks=ranks, stages=stages, cuts=cuts)
    assert group.rank_size == ranks * stages
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x", width=16))
    text = "\n".join(report)
    if stages == 1:
        assert "'fc': column-parallel" in text and "row-parallel + allreduce-sum" in text
        ops = group.stages[0].program
        assert sum(isinstance(op, AllReduceOp) for op in ops) == 1
    assert "'lone': column-parallel" in text and "allgather" in text
    assert any(isinstance(op, AllGatherOp) for s in group.stages for op in s.program)


def test_tensor_parallel_weights_are_split(tmp_path: Path) -> None:
    path = _save(tmp_path, _mlp_graph())
    tensor_parallel(path, tmp_path / "repo", ranks=4)
    model = onnx.load(str(tmp_path / "repo/model/1/rank_1/segment0.onnx"))
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    assert shapes["W1"] == [16, 8] and shapes["b1"] == [8] and shapes["W2"] == [8, 16]
    assert "b2" not in shapes  # the second bias runs after the allreduce, in segment1
    after = onnx.load(str(tmp_path / "repo/model/1/rank_1/segment1.onnx"))
    assert [t.dims for t in after.graph.initializer if t.name == "b2"] == [[16]]


def test_tensor_parallel_replicates_what_it_cannot_split(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"], "odd"),
        helper.make_node("MatMul", ["a", "x2"], ["y"], "activation_product"),
    ]
    graph = helper.make_graph(
        nodes,
        "odd",
        [_fp("x", 3, 6), _fp("x2", 5, 4)],
        [_fp("y", 3, 4)],
        initializer=[_init("W", 6, 5)],
    )
    path = _save(tmp_path, graph)
    group, report = tensor_parallel(path, tmp_path / "repo", ranks=2)
    assert any("'odd': replicated (5 columns not divisible by 2)" in r for r in report)
    assert any(
        "'activation_product': replicated (its weight is not an initializer)" in r for r in report
    )
    assert all(not isinstance(op, AllGatherOp | AllReduceOp) for op in group.stages[0].program)
    feeds = {
        "x": RNG.standard_normal((3, 6)).astype(np.float32),
        "x2": RNG.standard_normal((5, 4)).astype(np.float32),
    }
    _assert_equal_to_original(path, tmp_path / "repo", group, feeds)


# ---------------------------------------------------------------- external data


def test_big_stages_use_external_data(tmp_path: Path) -> None:
    path = _save(tmp_path, _mlp_graph())
    group, _ = tensor_parallel(path, tmp_path / "repo", ranks=2, external_threshold=256)
    files = group.ranks[0].files
    assert "segment0.onnx.data" in files and "segment0.onnx" in files
    segment = tmp_path / "repo/model/1/rank_0/segment0.onnx"
    assert check_external_data(segment) == ["segment0.onnx.data"]
    assert segment.stat().st_size < 2048  # the weights are not inside
    _assert_equal_to_original(path, tmp_path / "repo", group, _feeds("x", width=16))


def _hostile_model(folder: Path, location: str) -> Path:
    weight = numpy_helper.from_array(np.ones((2, 2), np.float32), "W")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "evil",
        [_fp("x", 2, 2)],
        [_fp("y", 2, 2)],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "evil.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize(
    "location", ["/etc/passwd", "../outside.bin", "sub/../../x.bin", "link/secret.bin"]
)
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    folder = tmp_path / "rank_0"
    folder.mkdir()
    os.symlink(tmp_path, folder / "link")
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnsafePathError, match="evil.onnx"):
        check_external_data(_hostile_model(folder, location))


def test_external_data_inside_the_folder_is_listed(tmp_path: Path) -> None:
    assert check_external_data(_hostile_model(tmp_path, "weights/w.bin")) == ["weights/w.bin"]


def test_same_model_same_bytes(tmp_path: Path) -> None:
    path = _save(tmp_path, _mlp_graph())
    for folder in ("a", "b"):
        tensor_parallel(
            path, tmp_path / folder, ranks=2, stages=2, cuts=["g"], external_threshold=256
        )
    files = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    assert any(str(f).endswith(".data") for f in files)
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
