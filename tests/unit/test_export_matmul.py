"""export_matmul: every cut computes what the unsliced network computes, and the repository
it writes is complete, confined per rank, loadable and reproducible byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from shardserve.errors import ExportError
from shardserve.repo.repository import (
    AllGatherOp,
    AllReduceOp,
    GroupConfig,
    RunOp,
    load_group,
    rank_dir,
    verify_rank_files,
    version_dir,
)
from shardserve.runtime.program import run_group_locally
from shardserve.servable import load_servable_config
from shardserve.tools.export.matmul import Strategy, export_matmul, reference_model

CUTS: list[tuple[int, int, Strategy]] = [
    (1, 1, "column"),
    (1, 1, "row"),
    (2, 1, "column"),
    (2, 1, "row"),
    (4, 1, "column"),
    (4, 1, "row"),
    (8, 1, "column"),
    (8, 1, "row"),
    (2, 2, "column"),
    (16, 2, "column"),
    (16, 2, "row"),
]


def reference_output(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        reference_model().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(["y"], {"x": x})[0]


async def run_sliced(repo: Path, group: GroupConfig, x: np.ndarray) -> np.ndarray:
    """Run every rank; all last-stage ranks must agree bit for bit. Returns their y."""
    results = await run_group_locally(repo, group, {"x": x})
    assert len(results) == group.ranks_per_stage
    first = results[0]["y"]
    for other in results[1:]:
        assert other["y"].tobytes() == first.tobytes()
    return first


def all_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize(("rank_size", "stage_size", "strategy"), CUTS)
async def test_sliced_matches_reference(
    tmp_path: Path, rank_size: int, stage_size: int, strategy: Strategy
) -> None:
    group = export_matmul(tmp_path, rank_size=rank_size, stage_size=stage_size, strategy=strategy)
    x = np.random.default_rng(7).uniform(-1, 1, size=(128, 96)).astype(np.float32)
    y = await run_sliced(tmp_path, group, x)
    assert y.shape == (128, 16)
    assert np.abs(y - reference_output(x)).max() <= 1e-5

    ones = await run_sliced(tmp_path, group, np.ones((128, 96), dtype=np.float32))
    assert np.all(ones == -48.0)


@pytest.mark.parametrize(
    ("rank_size", "stage_size", "strategy"),
    [(2, 1, "column"), (4, 1, "row"), (16, 2, "column"), (16, 2, "row")],
)
async def test_stacked_instances_give_each_instance_its_own_bits(
    tmp_path: Path, rank_size: int, stage_size: int, strategy: Strategy
) -> None:
    """Three instances stacked in one job (allgather axis shifted, allreduce as is, every
    segment once per instance) give exactly what each instance gives alone."""
    group = export_matmul(tmp_path, rank_size=rank_size, stage_size=stage_size, strategy=strategy)
    rng = np.random.default_rng(11)
    xs = [rng.uniform(-1, 1, size=(128, 96)).astype(np.float32) for _ in range(3)]
    stacked = await run_group_locally(tmp_path, group, {"x": np.stack(xs)}, stacked=3)
    assert len(stacked) == group.ranks_per_stage
    for rank_result in stacked:
        assert rank_result["y"].shape == (3, 128, 16)
        for i, x in enumerate(xs):
            alone = await run_sliced(tmp_path, group, x)
            assert rank_result["y"][i].tobytes() == alone.tobytes()
            assert np.abs(rank_result["y"][i] - reference_output(x)).max() <= 1e-5


@pytest.mark.parametrize(("rank_size", "stage_size", "strategy"), CUTS)
def test_repository_is_valid_and_each_rank_holds_only_its_files(
    tmp_path: Path, rank_size: int, stage_size: int, strategy: Strategy
) -> None:
    export_matmul(tmp_path, rank_size=rank_size, stage_size=stage_size, strategy=strategy)
    group = load_group(tmp_path, "matmul", 1)
    assert (group.rank_size, group.stage_size, group.with_batch_dim) == (
        rank_size,
        stage_size,
        False,
    )
    assert group.origin["strategy"] == strategy
    folder = version_dir(tmp_path, "matmul", 1)
    expected = {"group.json", "rank_table.json"} | {f"rank_{r}" for r in range(rank_size)}
    assert {p.name for p in folder.iterdir()} == expected
    for rank in range(rank_size):
        assert set(verify_rank_files(tmp_path, group, rank)) == set(group.ranks[rank].files)
        on_disk = {p.name for p in rank_dir(tmp_path, "matmul", 1, rank).iterdir()}
        assert on_disk == set(group.ranks[rank].files)


def test_unsliced_export_is_one_segment_without_collectives(tmp_path: Path) -> None:
    group = export_matmul(tmp_path, rank_size=1)
    assert group.stages[0].program == (RunOp(file="seg0.onnx"),)
    model = onnx.load(str(rank_dir(tmp_path, "matmul", 1, 0) / "seg0.onnx"))
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Neg"]


def test_column_strategy_gives_each_rank_its_weight_columns(tmp_path: Path) -> None:
    group = export_matmul(tmp_path, rank_size=8, strategy="column")
    assert group.stages[0].program == (
        RunOp(file="seg0.onnx"),
        AllGatherOp(input="y_part", output="y", axis=1),
    )
    model = onnx.load(str(rank_dir(tmp_path, "matmul", 1, 3) / "seg0.onnx"))
    weights = [i for i in model.graph.initializer if i.name == "weight"]
    assert list(weights[0].dims) == [96, 2]


def test_row_strategy_slices_x_and_negates_after_the_allreduce(tmp_path: Path) -> None:
    group = export_matmul(tmp_path, rank_size=4, strategy="row")
    assert group.stages[0].program == (
        RunOp(file="seg0.onnx"),
        AllReduceOp(input="xw_part", output="xw"),
        RunOp(file="seg1.onnx"),
    )
    seg0 = onnx.load(str(rank_dir(tmp_path, "matmul", 1, 2) / "seg0.onnx"))
    assert [n.op_type for n in seg0.graph.node] == ["Slice", "MatMul"]
    assert [list(i.dims) for i in seg0.graph.initializer if i.name == "weight"] == [[24, 16]]


def test_two_stages_hand_the_product_to_the_neg_stage(tmp_path: Path) -> None:
    group = export_matmul(tmp_path, rank_size=16, stage_size=2, strategy="row")
    assert group.stages[0].ranks == tuple(range(8))
    assert group.stages[1].ranks == tuple(range(8, 16))
    assert group.stages[0].outputs == group.stages[1].inputs == ("xw",)
    assert group.stages[1].program[-1] == AllGatherOp(input="y_part", output="y", axis=1)
    assert {r.stage for r in group.ranks[8:]} == {1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"rank_size": 32, "strategy": "column"},
            "column strategy splits 16 weight columns; 32 ranks per stage do not divide 16",
        ),
        ({"rank_size": 5, "strategy": "row"}, "5 ranks per stage do not divide 96"),
        ({"rank_size": 3, "stage_size": 2}, "rank_size 3 is not a multiple of stage_size 2"),
        ({"rank_size": 6, "stage_size": 3}, "stage_size must be 1 or 2, got 3"),
        ({"rank_size": 24, "stage_size": 2, "strategy": "row"}, "stage 1 (Neg) splits 16"),
        ({"rank_size": 2, "strategy": "diagonal"}, "strategy must be 'column' or 'row'"),
        ({"rank_size": 0}, "must be >= 1"),
        ({"rank_size": 1, "name": "../escape"}, "servable name '../escape'"),
        ({"rank_size": 1, "version": 0}, "version must be >= 1"),
    ],
)
def test_refusals_say_why(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ExportError) as excinfo:
        export_matmul(tmp_path, **kwargs)
    assert message in str(excinfo.value)
    assert not (tmp_path / "matmul" / "1").exists()


def test_existing_version_is_refused_unless_overwrite(tmp_path: Path) -> None:
    export_matmul(tmp_path, rank_size=2)
    with pytest.raises(ExportError, match="already exists"):
        export_matmul(tmp_path, rank_size=4)
    group = export_matmul(tmp_path, rank_size=4, overwrite=True)
    assert load_group(tmp_path, "matmul", 1) == group
    assert not (version_dir(tmp_path, "matmul", 1) / "rank_4").exists()
    assert sorted(p.name for p in (tmp_path / "matmul").iterdir()) == ["1", "servable_config.py"]


@pytest.mark.parametrize(
    ("rank_size", "stage_size", "strategy"), [(8, 1, "row"), (16, 2, "column")]
)
def test_export_is_deterministic(
    tmp_path: Path, rank_size: int, stage_size: int, strategy: Strategy
) -> None:
    groups = [
        export_matmul(
            tmp_path / where, rank_size=rank_size, stage_size=stage_size, strategy=strategy
        )
        for where in ("a", "b")
    ]
    assert groups[0] == groups[1]
    first, second = all_files(tmp_path / "a"), all_files(tmp_path / "b")
    segments = sum(len(rank.files) for rank in groups[0].ranks)
    assert len(first) == 3 + segments  # + group.json, rank_table.json, servable_config.py
    assert first == second


def test_servable_config_loads(tmp_path: Path) -> None:
    export_matmul(tmp_path, rank_size=16, stage_size=2, name="mm16")
    definition = load_servable_config(tmp_path / "mm16" / "servable_config.py")
    assert definition.model is not None
    assert (definition.model.rank_size, definition.model.stage_size) == (16, 2)
    assert definition.model.with_batch_dim is False
    method = definition.methods["predict"]
    assert (method.input_names, method.output_names) == (("x",), ("y",))
    assert [stage.is_model for stage in method.stages] == [True]


def test_progress_reports_every_rank(tmp_path: Path) -> None:
    lines: list[str] = []
    export_matmul(tmp_path, rank_size=4, progress=lines.append)
    for rank in range(4):
        assert any(line.startswith(f"rank {rank}/4: wrote seg0.onnx") for line in lines)
