"""The demo "matmul" servable: x[128, 96] @ W[96, 16] (all 0.5) -> Neg -> y[128, 16].

Column strategy: each rank of the MatMul stage holds W[:, its columns], computes its
columns of the product and an allgather on axis 1 joins them. Row strategy: each rank
slices its share of x's columns (Slice inside the segment), multiplies by its W rows, and
an allreduce-sum joins the partial products. With stage_size 2, Neg is stage 1 (each rank
negates its columns of the product, then allgather); with 1 rank per stage nothing is cut.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from shardserve.errors import ExportError
from shardserve.repo.repository import AllGatherOp, AllReduceOp, GroupConfig, ProgramOp, RunOp
from shardserve.tools.common import (
    ExportPlan,
    GraphBuilder,
    Progress,
    StagePlan,
    check_divides,
    check_layout,
    split_range,
    write_version,
)
from shardserve.tools.quantize.graph import QuantizeSpec
from shardserve.wire.protocol import TensorSpec

Strategy = Literal["column", "row"]

ROWS, IN_FEATURES, OUT_FEATURES = 128, 96, 16
WEIGHT_VALUE = 0.5
X_SHAPE = [ROWS, IN_FEATURES]
Y_SHAPE = [ROWS, OUT_FEATURES]
SEG0, SEG1 = "seg0.onnx", "seg1.onnx"


def export_matmul(
    out: Path,
    *,
    rank_size: int,
    stage_size: int = 1,
    strategy: Strategy = "column",
    version: int = 1,
    name: str = "matmul",
    progress: Progress | None = None,
    overwrite: bool = False,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write the matmul servable into the repository ``out``, cut for ``rank_size`` ranks.

    ``stage_size`` may be 1 (MatMul and Neg in one stage) or 2 (stage 0 MatMul, stage 1
    Neg); the network has only two ops, so deeper pipelines are refused. The ranks of a
    stage must divide the dimension they split: 16 weight columns (column strategy and the
    Neg stage) or the 96-long reduction dimension (row strategy). Same arguments, same bytes.
    """
    parts = _check_arguments(rank_size, stage_size, strategy)
    stages = _stage_plans(strategy, parts, stage_size)
    plan = ExportPlan(
        servable=name,
        version=version,
        rank_size=rank_size,
        stage_size=stage_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=tuple(X_SHAPE)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=tuple(Y_SHAPE)),),
        stages=stages,
        with_batch_dim=False,
        origin={
            "exporter": "shardserve.export.matmul",
            "strategy": strategy,
            "rank_size": rank_size,
            "stage_size": stage_size,
            "weight_value": WEIGHT_VALUE,
        },
    )

    def segments_for_rank(rank: int) -> dict[str, onnx.ModelProto]:
        stage, index = divmod(rank, parts)
        if stage_size == 2 and stage == 1:
            return {SEG0: _neg_segment(parts, index, rank)}
        return _matmul_segments(strategy, parts, index, rank, with_neg=stage_size == 1)

    return write_version(
        out, plan, segments_for_rank, progress, overwrite=overwrite, quantize=quantize
    )


def reference_model() -> onnx.ModelProto:
    """The unsliced network, for comparisons."""
    g = GraphBuilder("matmul")
    product = g.op("MatMul", "x", g.constant("weight", _weight()))
    g.op("Neg", product, out="y")
    return g.build(inputs=[("x", X_SHAPE)], outputs=[("y", Y_SHAPE)])


def _weight() -> np.ndarray:
    return np.full((IN_FEATURES, OUT_FEATURES), WEIGHT_VALUE, dtype=np.float32)


def _check_arguments(rank_size: int, stage_size: int, strategy: str) -> int:
    """Refuse what cannot be cut; return the ranks per stage."""
    if strategy not in ("column", "row"):
        raise ExportError(f"strategy must be 'column' or 'row', got {strategy!r}")
    if stage_size > 2:
        raise ExportError(
            f"the matmul network has two ops (MatMul, Neg), so stage_size must be 1 or 2, "
            f"got {stage_size}"
        )
    parts = check_layout(rank_size, stage_size)
    if strategy == "column":
        check_divides(OUT_FEATURES, parts, f"column strategy splits {OUT_FEATURES} weight columns")
    else:
        check_divides(
            IN_FEATURES, parts, f"row strategy splits the {IN_FEATURES}-long reduction dimension"
        )
    if stage_size == 2:
        check_divides(OUT_FEATURES, parts, f"stage 1 (Neg) splits {OUT_FEATURES} columns")
    return parts


# ---------------------------------------------------------------- stage programs


def _stage_plans(strategy: Strategy, parts: int, stage_size: int) -> tuple[StagePlan, ...]:
    if stage_size == 1:
        return (_matmul_stage(strategy, parts, with_neg=True),)
    return (_matmul_stage(strategy, parts, with_neg=False), _neg_stage(parts))


def _matmul_stage(strategy: Strategy, parts: int, *, with_neg: bool) -> StagePlan:
    """x -> MatMul (-> Neg when this is the only stage); the product is named "xw"."""
    final = "y" if with_neg else "xw"
    program: tuple[ProgramOp, ...] = (RunOp(file=SEG0),)
    if parts > 1 and strategy == "column":
        program += (AllGatherOp(input=f"{final}_part", output=final, axis=1),)
    elif parts > 1:
        program += (AllReduceOp(input="xw_part", output="xw"),)
        if with_neg:
            program += (RunOp(file=SEG1),)  # Neg once, on the summed product
    return StagePlan(inputs=("x",), outputs=(final,), program=program)


def _neg_stage(parts: int) -> StagePlan:
    program: tuple[ProgramOp, ...] = (RunOp(file=SEG0),)
    if parts > 1:
        program += (AllGatherOp(input="y_part", output="y", axis=1),)
    return StagePlan(inputs=("xw",), outputs=("y",), program=program)


# ---------------------------------------------------------------- segments


def _matmul_segments(
    strategy: Strategy, parts: int, index: int, rank: int, *, with_neg: bool
) -> dict[str, onnx.ModelProto]:
    final = "y" if with_neg else "xw"
    g = GraphBuilder(f"matmul_rank{rank}_seg0")
    if parts == 1:
        product = g.op(
            "MatMul", "x", g.constant("weight", _weight()), out=None if with_neg else final
        )
        if with_neg:
            g.op("Neg", product, out=final)
        return {SEG0: g.build(inputs=[("x", X_SHAPE)], outputs=[(final, Y_SHAPE)])}
    if strategy == "column":
        return {SEG0: _column_segment(g, parts, index, final, with_neg)}
    rows = split_range(IN_FEATURES, parts, index)
    x_share = g.slice_axis("x", 1, rows)
    g.op("MatMul", x_share, g.constant("weight", _weight()[rows, :]), out="xw_part")
    segments = {SEG0: g.build(inputs=[("x", X_SHAPE)], outputs=[("xw_part", Y_SHAPE)])}
    if with_neg:
        segments[SEG1] = _negate(GraphBuilder(f"matmul_rank{rank}_seg1"), "xw", "y", 1, 0)
    return segments


def _column_segment(
    g: GraphBuilder, parts: int, index: int, final: str, with_neg: bool
) -> onnx.ModelProto:
    cols = split_range(OUT_FEATURES, parts, index)
    output = f"{final}_part"
    product = g.op(
        "MatMul", "x", g.constant("weight", _weight()[:, cols]), out=None if with_neg else output
    )
    if with_neg:
        g.op("Neg", product, out=output)
    return g.build(inputs=[("x", X_SHAPE)], outputs=[(output, [ROWS, OUT_FEATURES // parts])])


def _neg_segment(parts: int, index: int, rank: int) -> onnx.ModelProto:
    output = "y" if parts == 1 else "y_part"
    return _negate(GraphBuilder(f"matmul_rank{rank}_seg0"), "xw", output, parts, index)


def _negate(g: GraphBuilder, source: str, output: str, parts: int, index: int) -> onnx.ModelProto:
    """``-source``, or with several ranks ``-source[:, this rank's columns]``."""
    columns = source
    if parts > 1:
        columns = g.slice_axis(source, 1, split_range(OUT_FEATURES, parts, index))
    g.op("Neg", columns, out=output)
    return g.build(inputs=[(source, Y_SHAPE)], outputs=[(output, [ROWS, OUT_FEATURES // parts])])
