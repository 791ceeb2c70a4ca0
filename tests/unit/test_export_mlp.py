"""export_mlp: Megatron-style cuts over tensor and pipeline parallel layouts compute what the
unsliced MLP computes (any batch size), weights load from .npz with clear refusals, and
the repository is valid, confined per rank and reproducible byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from shardserve.errors import ExportError
from shardserve.repo.repository import (
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
from shardserve.tools.export.mlp import (
    MlpShape,
    export_mlp,
    random_weights,
    reference_model,
    stage_blocks,
)

HIDDEN, FFN = 32, 64
CUTS = [
    (1, 1, 2),
    (2, 1, 2),
    (4, 1, 2),
    (8, 1, 2),
    (2, 2, 2),
    (4, 2, 2),
    (8, 2, 2),
    (4, 4, 4),
    (8, 4, 4),
    (4, 2, 3),  # uneven: stage 0 gets blocks 0-1, stage 1 block 2
]


def reference_output(x: np.ndarray, **kwargs: Any) -> np.ndarray:
    model = reference_model(**kwargs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


async def run_sliced(repo: Path, group: GroupConfig, x: np.ndarray) -> np.ndarray:
    """Run every rank; all last-stage ranks must agree bit for bit. Returns their y."""
    results = await run_group_locally(repo, group, {"x": x})
    assert len(results) == group.ranks_per_stage
    first = results[0]["y"]
    for other in results[1:]:
        assert other["y"].tobytes() == first.tobytes()
    return first


def batch(rows: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, HIDDEN)).astype(np.float32)


def save_npz(path: Path, weights: dict[str, np.ndarray]) -> None:
    arrays: dict[str, Any] = dict(weights)  # numpy's stubs mistype savez(**arrays)
    np.savez(path, **arrays)


def all_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize(("rank_size", "stage_size", "layers"), CUTS)
async def test_sliced_matches_reference(
    tmp_path: Path, rank_size: int, stage_size: int, layers: int
) -> None:
    group = export_mlp(
        tmp_path,
        hidden=HIDDEN,
        ffn=FFN,
        layers=layers,
        rank_size=rank_size,
        stage_size=stage_size,
        seed=11,
    )
    for rows in (1, 5):
        x = batch(rows)
        y = await run_sliced(tmp_path, group, x)
        expected = reference_output(x, hidden=HIDDEN, ffn=FFN, layers=layers, seed=11)
        assert y.shape == (rows, HIDDEN)
        assert np.abs(y - expected).max() <= 1e-5
        assert np.abs(y - x).max() > 1e-3  # the blocks did something beyond the residual


@pytest.mark.parametrize(("rank_size", "stage_size", "layers"), CUTS)
def test_repository_is_valid_and_each_rank_holds_only_its_files(
    tmp_path: Path, rank_size: int, stage_size: int, layers: int
) -> None:
    export_mlp(
        tmp_path, hidden=HIDDEN, ffn=FFN, layers=layers, rank_size=rank_size, stage_size=stage_size
    )
    group = load_group(tmp_path, "mlp", 1)
    assert group.with_batch_dim is True
    assert group.max_batch_size == 0
    assert [(s.name, s.shape) for s in group.inputs] == [("x", (-1, 32))]
    assert [(s.name, s.shape) for s in group.outputs] == [("y", (-1, 32))]
    folder = version_dir(tmp_path, "mlp", 1)
    expected = {"group.json", "rank_table.json"} | {f"rank_{r}" for r in range(rank_size)}
    assert {p.name for p in folder.iterdir()} == expected
    for rank in range(rank_size):
        assert set(verify_rank_files(tmp_path, group, rank)) == set(group.ranks[rank].files)
        on_disk = {p.name for p in rank_dir(tmp_path, "mlp", 1, rank).iterdir()}
        assert on_disk == set(group.ranks[rank].files)


def test_program_has_one_allreduce_per_block_of_the_stage(tmp_path: Path) -> None:
    group = export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, layers=3, rank_size=4, stage_size=2)
    first, second = group.stages
    assert (first.inputs, first.outputs, second.inputs, second.outputs) == (
        ("x",),
        ("h2",),
        ("h2",),
        ("y",),
    )
    assert first.program == (
        RunOp(file="seg0.onnx"),
        AllReduceOp(input="block0.partial", output="block0.sum"),
        RunOp(file="seg1.onnx"),
        AllReduceOp(input="block1.partial", output="block1.sum"),
        RunOp(file="seg2.onnx"),
    )
    assert second.collective_count == 1


def test_unsliced_stages_have_no_collectives(tmp_path: Path) -> None:
    group = export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, layers=2, rank_size=2, stage_size=2)
    assert [s.program for s in group.stages] == [(RunOp(file="seg0.onnx"),)] * 2


def test_each_rank_holds_its_shard_and_fc2_bias_is_added_once(tmp_path: Path) -> None:
    export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, layers=2, rank_size=4)
    folder = rank_dir(tmp_path, "mlp", 1, 1)
    seg0 = {i.name: list(i.dims) for i in onnx.load(str(folder / "seg0.onnx")).graph.initializer}
    seg1 = {i.name: list(i.dims) for i in onnx.load(str(folder / "seg1.onnx")).graph.initializer}
    assert seg0["block0.fc1.weight"] == [32, 16]
    assert seg0["block0.fc1.bias"] == [16]
    assert seg0["block0.fc2.weight"] == [16, 32]
    assert "block0.fc2.bias" not in seg0  # before the allreduce: would be summed 4 times
    assert seg1["block0.fc2.bias"] == [32]


def test_blocks_spread_evenly_over_stages() -> None:
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


async def test_weights_from_npz(tmp_path: Path) -> None:
    shape = MlpShape(hidden=32, ffn=64, layers=2)
    npz = tmp_path / "weights.npz"
    save_npz(npz, random_weights(99, shape))
    group = export_mlp(
        tmp_path / "repo", hidden=HIDDEN, ffn=FFN, layers=2, rank_size=4, weights=npz
    )
    assert str(group.origin["weights"]).startswith("npz sha256 ")
    x = batch(3)
    y = await run_sliced(tmp_path / "repo", group, x)
    assert (
        np.abs(y - reference_output(x, hidden=HIDDEN, ffn=FFN, layers=2, weights=npz)).max() <= 1e-5
    )
    assert np.abs(y - reference_output(x, hidden=HIDDEN, ffn=FFN, layers=2, seed=0)).max() > 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: w.pop("block1.fc2.bias"), "missing block1.fc2.bias"),
        (
            lambda w: w.update({"block2.fc1.bias": w["block0.fc1.bias"]}),
            "unexpected block2.fc1.bias",
        ),
        (
            lambda w: w.update({"block0.fc1.weight": w["block0.fc2.weight"]}),
            "block0.fc1.weight has shape [64, 32], expected [32, 64]",
        ),
        (
            lambda w: w.update({"block0.fc1.bias": np.zeros(64, dtype=np.int32)}),
            "block0.fc1.bias has dtype int32",
        ),
    ],
)
def test_bad_weights_are_refused_by_name(tmp_path: Path, edit: Any, message: str) -> None:
    weights = random_weights(0, MlpShape(hidden=32, ffn=64, layers=2))
    edit(weights)
    npz = tmp_path / "weights.npz"
    save_npz(npz, weights)
    with pytest.raises(ExportError) as excinfo:
        export_mlp(tmp_path / "repo", hidden=HIDDEN, ffn=FFN, layers=2, weights=npz)
    assert message in str(excinfo.value)


def test_unreadable_weights_are_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.npz"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(ExportError, match="cannot read weights"):
        export_mlp(tmp_path / "repo", hidden=HIDDEN, ffn=FFN, weights=bogus)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 2, "rank_size": 4, "stage_size": 4}, "2 blocks cannot fill 4 pipeline stages"),
        ({"rank_size": 3}, "3 ranks per stage do not divide 64"),
        ({"rank_size": 10, "stage_size": 2}, "5 ranks per stage do not divide 64"),
        ({"rank_size": 4, "stage_size": 3, "layers": 3}, "not a multiple of stage_size 3"),
        ({"layers": 0}, "layers must be >= 1"),
    ],
)
def test_refusals_say_why(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ExportError) as excinfo:
        export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, **kwargs)
    assert message in str(excinfo.value)
    assert not (tmp_path / "mlp").exists()


@pytest.mark.parametrize(("rank_size", "stage_size", "layers"), [(8, 2, 2), (4, 4, 4)])
def test_export_is_deterministic(
    tmp_path: Path, rank_size: int, stage_size: int, layers: int
) -> None:
    for where in ("a", "b"):
        export_mlp(
            tmp_path / where,
            hidden=HIDDEN,
            ffn=FFN,
            layers=layers,
            rank_size=rank_size,
            stage_size=stage_size,
        )
    first, second = all_files(tmp_path / "a"), all_files(tmp_path / "b")
    assert any(name.endswith(".onnx") for name in first)
    assert first == second


def test_different_seeds_give_different_weights(tmp_path: Path) -> None:
    export_mlp(tmp_path / "a", hidden=HIDDEN, ffn=FFN, seed=1)
    export_mlp(tmp_path / "b", hidden=HIDDEN, ffn=FFN, seed=2)
    seg = Path("mlp/1/rank_0/seg0.onnx")
    assert (tmp_path / "a" / seg).read_bytes() != (tmp_path / "b" / seg).read_bytes()


def test_servable_config_loads(tmp_path: Path) -> None:
    export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, rank_size=8, stage_size=2)
    definition = load_servable_config(tmp_path / "mlp" / "servable_config.py")
    assert definition.model is not None
    assert (definition.model.rank_size, definition.model.stage_size) == (8, 2)
    assert definition.model.with_batch_dim is True
    method = definition.methods["predict"]
    assert (method.input_names, method.output_names) == (("x",), ("y",))


def test_progress_reports_every_rank(tmp_path: Path) -> None:
    lines: list[str] = []
    export_mlp(tmp_path, hidden=HIDDEN, ffn=FFN, rank_size=4, stage_size=2, progress=lines.append)
    for rank in range(4):
        assert any(line.startswith(f"rank {rank}/4: wrote seg0.onnx") for line in lines)
