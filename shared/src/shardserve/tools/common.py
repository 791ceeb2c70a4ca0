"""What every exporter shares: layout checks and the repository writer (the ONNX
building is ``shardserve.tools.onnx_graph``, re-exported here).

Exporters describe a servable version as an ``ExportPlan`` (stages, programs, signature)
plus a function giving each rank's segments; ``write_version`` writes the rank folders
(only that rank's files), group.json with per-rank sha256, rank_table.json and
servable_config.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

from shardserve.errors import ExportError
from shardserve.repo.repository import (
    RANK_TABLE_FILE,
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    ProgramOp,
    RankSpec,
    StageSpec,
    rank_checksum,
    rank_table,
    sha256_file,
    write_group,
)
from shardserve.servable import GENERATION_TASK
from shardserve.tools.onnx_graph import (
    IR_VERSION,
    OPSET,
    PRODUCER_NAME,
    PRODUCER_VERSION,
    GraphBuilder,
    Shape,
    finish_model,
    model_bytes,
)
from shardserve.tools.quantize.graph import QuantizeSpec, quantize_segments, quantized_origin
from shardserve.wire.protocol import TensorSpec

Progress = Callable[[str], None]
"""Receives one human-readable line per step of an export (e.g. per rank written)."""

ORIGIN_VALUE = str | int | float | bool

_SERVABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


# ---------------------------------------------------------------- checks


def check_layout(rank_size: int, stage_size: int) -> int:
    """Refuse impossible rank/stage combinations; return the ranks per stage."""
    if rank_size < 1 or stage_size < 1:
        raise ExportError(f"rank_size and stage_size must be >= 1, got {rank_size}, {stage_size}")
    if rank_size % stage_size != 0:
        raise ExportError(
            f"rank_size {rank_size} is not a multiple of stage_size {stage_size}: "
            f"every pipeline stage needs the same number of ranks"
        )
    return rank_size // stage_size


def check_divides(total: int, parts: int, what: str) -> None:
    """Refuse a split that leaves ranks with unequal shares, e.g.
    ``check_divides(16, 32, "column strategy splits 16 weight columns")``."""
    if total % parts != 0:
        raise ExportError(f"{what}; {parts} ranks per stage do not divide {total}")


def check_servable_name(name: str, version: int) -> None:
    if not _SERVABLE_NAME.match(name):
        raise ExportError(
            f"servable name {name!r} must be letters, digits, '_', '-' or '.', "
            f"not starting with '.' or '-'"
        )
    if version < 1:
        raise ExportError(f"version must be >= 1, got {version}")


def split_range(total: int, parts: int, index: int) -> slice:
    """The ``index``-th of ``parts`` equal, contiguous shares of ``range(total)``."""
    share = total // parts
    return slice(index * share, (index + 1) * share)


def stage_ranks(rank_size: int, stage_size: int, stage: int) -> tuple[int, ...]:
    """The ranks of a stage: consecutive, as in group.json (rank // ranks_per_stage)."""
    per_stage = rank_size // stage_size
    return tuple(range(stage * per_stage, (stage + 1) * per_stage))


# ---------------------------------------------------------------- repository writing


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage as group.json lists it (its ranks are derived from the layout)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    program: tuple[ProgramOp, ...]


@dataclass(frozen=True)
class ExportPlan:
    """Everything about a servable version except the segment bytes."""

    servable: str
    version: int
    rank_size: int
    stage_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stages: tuple[StagePlan, ...]
    with_batch_dim: bool = False
    max_batch_size: int = 0
    origin: Mapping[str, ORIGIN_VALUE] = field(default_factory=dict)
    method: str = "predict"

    def stage_specs(self) -> tuple[StageSpec, ...]:
        return tuple(
            StageSpec(
                index=i,
                ranks=stage_ranks(self.rank_size, self.stage_size, i),
                inputs=s.inputs,
                outputs=s.outputs,
                program=s.program,
            )
            for i, s in enumerate(self.stages)
        )


SegmentsForRank = Callable[[int], Mapping[str, onnx.ModelProto]]
"""rank -> {file name: model}; called once per rank, so only one rank's slice is in memory."""


def write_version(
    out: Path,
    plan: ExportPlan,
    segments_for_rank: SegmentsForRank,
    progress: Progress | None = None,
    overwrite: bool = False,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write ``out/<servable>/<version>/`` and ``out/<servable>/servable_config.py``
    (each rank's segments quantized by ``quantize`` when given).

    The version folder is built under a temporary name and renamed into place, so a
    reader never sees half a version. An existing version is refused unless ``overwrite``.
    """
    check_servable_name(plan.servable, plan.version)
    check_layout(plan.rank_size, plan.stage_size)
    servable_dir = out / plan.servable
    plan = replace(plan, origin=quantized_origin(plan.origin, quantize))

    def quantized_for_rank(rank: int) -> Mapping[str, onnx.ModelProto]:
        return quantize_segments(segments_for_rank(rank), quantize)

    with staged_version(servable_dir, plan.version, overwrite=overwrite) as staging:
        group = _write_version_files(staging, plan, quantized_for_rank, progress)
    write_text_atomic(servable_dir / SERVABLE_CONFIG_FILE, servable_config_text(plan))
    final = servable_dir / str(plan.version)
    report_progress(progress, f"wrote {final} ({plan.rank_size} ranks, {plan.stage_size} stages)")
    return group


def _write_version_files(
    folder: Path, plan: ExportPlan, segments_for_rank: SegmentsForRank, progress: Progress | None
) -> GroupConfig:
    stages = plan.stage_specs()
    per_stage = plan.rank_size // plan.stage_size
    ranks = []
    for rank in range(plan.rank_size):
        segments = segments_for_rank(rank)
        _check_program_files(stages[rank // per_stage], segments, rank)
        spec = write_rank(folder, rank, rank // per_stage, segments)
        ranks.append(spec)
        size = sum((folder / f"rank_{rank}" / n).stat().st_size for n in spec.files)
        report_progress(
            progress, f"rank {rank}/{plan.rank_size}: wrote {', '.join(spec.files)} ({size} bytes)"
        )
    group = group_config(plan, ranks)
    write_group(folder, group)
    write_rank_table(folder, plan.rank_size)
    return group


def group_config(plan: ExportPlan, ranks: Sequence[RankSpec]) -> GroupConfig:
    """group.json's content: ``plan`` and the ranks written for it."""
    return GroupConfig(
        servable=plan.servable,
        version=plan.version,
        rank_size=plan.rank_size,
        stage_size=plan.stage_size,
        inputs=plan.inputs,
        outputs=plan.outputs,
        with_batch_dim=plan.with_batch_dim,
        max_batch_size=plan.max_batch_size,
        stages=plan.stage_specs(),
        ranks=tuple(ranks),
        origin=dict(plan.origin),
    )


def _check_program_files(
    stage: StageSpec, segments: Mapping[str, onnx.ModelProto], rank: int
) -> None:
    """Every file the stage program runs must be among the rank's segments, and vice versa."""
    needed = {op.file for op in stage.program if op.op == "run"}
    if needed != set(segments):
        raise ExportError(
            f"rank {rank}: stage {stage.index} program runs {sorted(needed)}, "
            f"but the exporter produced {sorted(segments)}"
        )


def write_rank(
    version_folder: Path, rank: int, stage: int, segments: Mapping[str, onnx.ModelProto]
) -> RankSpec:
    """Write ``rank_<rank>/<file>`` for each segment; return the RankSpec with sha256s."""
    folder = version_folder / f"rank_{rank}"
    folder.mkdir(parents=True, exist_ok=False)
    files: dict[str, str] = {}
    for name in sorted(segments):
        if "/" in name or name.startswith("."):
            raise ExportError(f"segment file name {name!r} must be a plain file name")
        path = folder / name
        path.write_bytes(model_bytes(segments[name]))
        files[name] = sha256_file(path)
    return RankSpec(rank=rank, stage=stage, files=files, checksum=rank_checksum(files))


def servable_config_text(plan: ExportPlan) -> str:
    """servable_config.py in MindSpore Serving's distributed shape, for this plan: a
    ``predict`` method over the model, or (group.json origin task "text-generation") a
    text-generation declaration without methods."""
    if plan.origin.get("task") == GENERATION_TASK:
        return _generation_config_text(plan)
    args = ", ".join(s.name for s in plan.inputs)
    outs = ", ".join(s.name for s in plan.outputs)
    names = ", ".join(f'"{s.name}"' for s in plan.outputs)
    return (
        f'"""Servable {plan.servable}: written by shardserve.tools.export '
        f'(rewritten by every export of this servable)."""\n\n'
        "from shardserve.servable import add_stage, declare_servable, register_method\n\n"
        f"model = declare_servable(rank_size={plan.rank_size}, stage_size={plan.stage_size}, "
        f"with_batch_dim={plan.with_batch_dim})\n\n\n"
        f"@register_method(output_names=[{names}])\n"
        f"def {plan.method}({args}):\n"
        f"    {outs} = add_stage(model, {args}, outputs_count={len(plan.outputs)})\n"
        f"    return {outs}\n"
    )


def _generation_config_text(plan: ExportPlan) -> str:
    # No predict method: it would get one step's packed rows and no KV cache, so it could
    # not answer anything useful; generate requests are the way in.
    return (
        f'"""Servable {plan.servable}: text generation, written by shardserve.tools.export\n'
        "(rewritten by every export of this servable).\n\n"
        "Called with generate requests, not methods: /v1/completions, /v1/chat/completions,\n"
        f"/v2/models/{plan.servable}/generate, Client.generate, a GenerateRequest on the queue\n"
        '(see docs/generation.md).\n"""\n\n'
        "from shardserve.servable import declare_servable\n\n"
        f"model = declare_servable(rank_size={plan.rank_size}, stage_size={plan.stage_size}, "
        "generation=True)\n"
    )


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def staged_version(
    servable_dir: Path, version: int, *, overwrite: bool = False, tag: str = "export"
) -> Iterator[Path]:
    """A scratch folder for ``servable_dir/<version>`` that takes its place when the block
    ends without an error (renamed into place: a reader never sees half a version). An
    existing version is refused unless ``overwrite``."""
    final = servable_dir / str(version)
    if final.exists() and not overwrite:
        raise ExportError(f"{final} already exists; choose another version or remove it")
    staging = servable_dir / f".{tag}-{version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # ours, left by an interrupted run
    staging.mkdir(parents=True)
    try:
        yield staging
        _replace_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_rank_table(version_folder: Path, rank_size: int) -> None:
    text = json.dumps(rank_table(rank_size), indent=2, sort_keys=True) + "\n"
    write_text_atomic(version_folder / RANK_TABLE_FILE, text)


def _replace_dir(staging: Path, final: Path) -> None:
    """Move ``staging`` to ``final``; an old ``final`` is moved aside first, then removed."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def report_progress(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line)


__all__ = [
    "IR_VERSION",
    "OPSET",
    "PRODUCER_NAME",
    "PRODUCER_VERSION",
    "Shape",
    "ExportPlan",
    "GraphBuilder",
    "Progress",
    "SegmentsForRank",
    "StagePlan",
    "check_divides",
    "check_layout",
    "check_servable_name",
    "finish_model",
    "group_config",
    "model_bytes",
    "report_progress",
    "servable_config_text",
    "split_range",
    "stage_ranks",
    "staged_version",
    "write_rank",
    "write_rank_table",
    "write_text_atomic",
    "write_version",
]
