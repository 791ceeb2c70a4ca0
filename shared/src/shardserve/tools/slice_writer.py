"""Writing per-rank slices into a model repository, with ONNX external data when a rank's
model would not fit protobuf's 2 GiB limit.

Shares the layout rules of ``shardserve.tools.common`` (servable name checks,
servable_config.py text, rank table) but each rank's program comes with its segments, and
big segments are written as ``<segment>.onnx`` + ``<segment>.onnx.data`` in the rank folder
(location relative, so the agent's confinement check accepts it). Every file, data files
included, is listed in the RankSpec with its sha256.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx
from onnx import external_data_helper

from shardserve.errors import ExportError
from shardserve.repo.repository import (
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    ProgramOp,
    RankSpec,
    rank_checksum,
    sha256_file,
    write_group,
)
from shardserve.tools.common import (
    ExportPlan,
    Progress,
    StagePlan,
    check_layout,
    check_servable_name,
    group_config,
    model_bytes,
    report_progress,
    servable_config_text,
    staged_version,
    write_rank_table,
    write_text_atomic,
)
from shardserve.tools.quantize.graph import QuantizeSpec, quantize_segments, quantized_origin
from shardserve.wire.protocol import TensorSpec

# protobuf refuses messages of 2 GiB and more; leave room for the graph itself.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**27


@dataclass(frozen=True)
class RankSlice:
    """One rank's stage program and the ONNX segments it runs (file name -> model)."""

    program: tuple[ProgramOp, ...]
    segments: Mapping[str, onnx.ModelProto]


@dataclass(frozen=True)
class SliceLayout:
    """Everything about a servable version except the per-rank slices."""

    servable: str
    version: int
    rank_size: int
    stage_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stage_io: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # (inputs, outputs)
    with_batch_dim: bool = False
    origin: Mapping[str, str | int | float | bool] = field(default_factory=dict)


def write_slices(
    out: Path,
    layout: SliceLayout,
    slice_for_rank: Callable[[int], RankSlice],
    progress: Progress | None = None,
    external_threshold: int = EXTERNAL_DATA_THRESHOLD,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write ``out/<servable>/<version>/`` (built aside, renamed into place) and
    ``out/<servable>/servable_config.py``; an existing version folder is refused. With
    ``quantize``, each rank's segments are quantized after slicing."""
    check_servable_name(layout.servable, layout.version)
    layout = replace(layout, origin=quantized_origin(layout.origin, quantize))
    per_stage = check_layout(layout.rank_size, layout.stage_size)
    servable_dir = out / layout.servable
    with staged_version(servable_dir, layout.version, tag="slice") as staging:
        programs: list[tuple[ProgramOp, ...]] = []
        ranks: list[RankSpec] = []
        for rank in range(layout.rank_size):
            piece = slice_for_rank(rank)
            piece = replace(piece, segments=quantize_segments(piece.segments, quantize))
            programs.append(_same_program(programs, piece, rank, per_stage))
            spec = _write_rank(staging, rank, rank // per_stage, piece, external_threshold)
            ranks.append(spec)
            report_progress(
                progress,
                f"rank {rank}/{layout.rank_size} (stage {spec.stage}): "
                f"{', '.join(sorted(spec.files))}",
            )
        plan = _plan(layout, [programs[s * per_stage] for s in range(layout.stage_size)])
        group = group_config(plan, ranks)
        write_group(staging, group)
        write_rank_table(staging, layout.rank_size)
    write_text_atomic(servable_dir / SERVABLE_CONFIG_FILE, servable_config_text(plan))
    final = servable_dir / str(layout.version)
    report_progress(
        progress, f"wrote {final} ({layout.rank_size} ranks, {layout.stage_size} stages)"
    )
    return group


def _same_program(
    programs: Sequence[tuple[ProgramOp, ...]], piece: RankSlice, rank: int, per_stage: int
) -> tuple[ProgramOp, ...]:
    """Every rank of a stage must run the same program (only the weights differ)."""
    first = rank - rank % per_stage
    if rank != first and programs[first] != piece.program:
        raise ExportError(f"rank {rank} has a different stage program than rank {first}")
    needed = {op.file for op in piece.program if op.op == "run"}
    if needed != set(piece.segments):
        raise ExportError(
            f"rank {rank}: program runs {sorted(needed)}, segments are {sorted(piece.segments)}"
        )
    return piece.program


def _write_rank(folder: Path, rank: int, stage: int, piece: RankSlice, threshold: int) -> RankSpec:
    rank_folder = folder / f"rank_{rank}"
    rank_folder.mkdir()
    files: dict[str, str] = {}
    for name in sorted(piece.segments):
        for written in save_model(piece.segments[name], rank_folder / name, threshold):
            files[written] = sha256_file(rank_folder / written)
    return RankSpec(rank=rank, stage=stage, files=files, checksum=rank_checksum(files))


def save_model(model: onnx.ModelProto, path: Path, threshold: int) -> list[str]:
    """Save deterministically; weights go to ``<name>.data`` beside it when the initializers
    exceed ``threshold`` bytes. Returns the file names written (relative to the folder)."""
    if "/" in path.name or path.name.startswith("."):
        raise ExportError(f"segment file name {path.name!r} must be a plain file name")
    if weight_bytes(model) <= threshold:
        path.write_bytes(model_bytes(model))
        return [path.name]
    data_name = f"{path.name}.data"
    (path.parent / data_name).unlink(missing_ok=True)  # onnx appends to an existing file
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    external_data_helper.convert_model_to_external_data(
        copy, all_tensors_to_one_file=True, location=data_name, size_threshold=0
    )
    external_data_helper.write_external_data_tensors(copy, str(path.parent))
    path.write_bytes(model_bytes(copy))
    return [path.name, data_name]


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers (what decides whether it fits in one protobuf)."""
    return sum(t.ByteSize() for t in model.graph.initializer)


def _plan(layout: SliceLayout, programs: Sequence[tuple[ProgramOp, ...]]) -> ExportPlan:
    """The ExportPlan of a layout whose stages run ``programs`` (one per stage)."""
    stages = tuple(
        StagePlan(ins, outs, program)
        for (ins, outs), program in zip(layout.stage_io, programs, strict=True)
    )
    return ExportPlan(
        servable=layout.servable,
        version=layout.version,
        rank_size=layout.rank_size,
        stage_size=layout.stage_size,
        inputs=layout.inputs,
        outputs=layout.outputs,
        stages=stages,
        with_batch_dim=layout.with_batch_dim,
        origin=layout.origin,
    )
