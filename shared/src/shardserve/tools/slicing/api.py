"""``slice_pipeline`` and ``tensor_parallel``: any ONNX model -> a servable version.

``slice_pipeline`` cuts the model into ``stages`` pipeline stages, one rank each.
``tensor_parallel`` does the same and then splits each stage over ``ranks`` ranks
(rank_size = stages x ranks), returning a report of which nodes were sharded how and which
stayed replicated and why. See ``pipeline`` for the cut rules and ``megatron`` for the
sharding patterns.

The servable's signature is the model's: its graph inputs and outputs (dims that are not
fixed become -1). ``with_batch_dim`` is True when every input and output has a first
dimension that is not fixed (a batch axis the scheduler may batch along).
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
from onnx import numpy_helper

from shardserve.errors import ExportError
from shardserve.repo.repository import GroupConfig
from shardserve.tools.quantize.graph import QuantizeSpec
from shardserve.tools.slice_writer import (
    EXTERNAL_DATA_THRESHOLD,
    RankSlice,
    SliceLayout,
    write_slices,
)
from shardserve.tools.slicing.graph import topological_nodes, value_types
from shardserve.tools.slicing.megatron import ShardingPlan, plan_sharding
from shardserve.tools.slicing.pipeline import (
    StageCut,
    balanced_assignment,
    build_stages,
    node_cost,
    stage_assignment_from_cuts,
)
from shardserve.tools.slicing.rewrite import segments, shard_stage
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import DTYPE_TO_DATATYPE

Progress = Callable[[str], None]


def slice_pipeline(
    model_path: Path,
    out: Path,
    *,
    stages: int,
    cuts: list[str] | None = None,
    name: str | None = None,
    version: int = 1,
    progress: Progress | None = None,
    external_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> GroupConfig:
    """Cut ``model_path`` into ``stages`` stages (one rank each) and write the version."""
    group, _ = tensor_parallel(
        model_path,
        out,
        ranks=1,
        stages=stages,
        cuts=cuts,
        name=name,
        version=version,
        progress=progress,
        external_threshold=external_threshold,
    )
    return group


def tensor_parallel(
    model_path: Path,
    out: Path,
    *,
    ranks: int,
    stages: int = 1,
    cuts: list[str] | None = None,
    name: str | None = None,
    version: int = 1,
    progress: Progress | None = None,
    external_threshold: int = EXTERNAL_DATA_THRESHOLD,
    quantize: QuantizeSpec | None = None,
) -> tuple[GroupConfig, list[str]]:
    """Cut into stages, split each stage over ``ranks`` ranks; returns (group, report)."""
    if ranks < 1 or stages < 1:
        raise ExportError(f"ranks and stages must be >= 1, got {ranks} and {stages}")
    if cuts is not None and len(cuts) != stages - 1:
        raise ExportError(f"{len(cuts)} cut(s) make {len(cuts) + 1} stages, but stages={stages}")
    model = load_model(model_path)
    nodes = topological_nodes(model.graph)
    inits = {t.name: t for t in model.graph.initializer}
    types = value_types(model)
    graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
    graph_outputs = [o.name for o in model.graph.output]
    assignment = (
        stage_assignment_from_cuts(nodes, cuts, model.graph)
        if cuts
        else _balanced(nodes, stages, inits, types)
    )
    cut = build_stages(nodes, assignment, graph_inputs, graph_outputs, set(inits))
    report = [_describe(k, c) for k, c in enumerate(cut)]
    plans = [_plan(c, inits, ranks, f"stage {k}", report) for k, c in enumerate(cut)]

    def slice_for_rank(rank: int) -> RankSlice:
        k = rank // ranks
        stage = shard_stage(cut[k].nodes, inits, types, plans[k], ranks, rank % ranks)
        program, models = segments(model, stage, cut[k].outputs, f"stage{k}_rank{rank}")
        return RankSlice(program, models)

    layout = SliceLayout(
        servable=name or _default_name(model_path),
        version=version,
        rank_size=stages * ranks,
        stage_size=stages,
        inputs=_specs(graph_inputs, types),
        outputs=_specs(graph_outputs, types),
        stage_io=tuple((c.inputs, c.outputs) for c in cut),
        with_batch_dim=_has_batch_dim([*graph_inputs, *graph_outputs], types),
        origin={"source": model_path.name, "tool": "shardserve.slicing", "tensor_parallel": ranks},
    )
    _check_identifiers(layout)
    group = write_slices(out, layout, slice_for_rank, progress, external_threshold, quantize)
    return group, report


def load_model(path: Path) -> onnx.ModelProto:
    """Load a model (with its external data) and turn Constant nodes into initializers,
    so a constant read by several stages is copied rather than carried."""
    if not path.is_file():
        raise ExportError(f"model file {path} does not exist")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # onnx raises protobuf DecodeError and friends
        raise ExportError(f"{path} is not a readable ONNX model: {exc}") from exc
    outputs = {o.name for o in model.graph.output}
    kept = []
    for node in model.graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None and node.output[0] not in outputs:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


def _balanced(
    nodes: Sequence[onnx.NodeProto],
    stages: int,
    inits: dict[str, onnx.TensorProto],
    types: dict[str, onnx.ValueInfoProto],
) -> list[int]:
    sizes = {n: numpy_helper.to_array(t).nbytes for n, t in inits.items()}
    shapes = {
        n: [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
        for n, v in types.items()
    }
    costs = [node_cost(node, sizes, shapes) for node in nodes]
    return balanced_assignment(nodes, stages, costs)


def _plan(
    cut: StageCut, inits: dict[str, onnx.TensorProto], ranks: int, label: str, report: list[str]
) -> ShardingPlan:
    if ranks == 1:
        return ShardingPlan()
    plan = plan_sharding(cut.nodes, inits, cut.outputs, ranks, label)
    if not plan.report:
        plan.report.append(f"{label}: no MatMul/Gemm; every node replicated on {ranks} ranks")
    else:
        plan.report.append(f"{label}: every other node replicated on all {ranks} ranks")
    report.extend(plan.report)
    return plan


def _describe(k: int, cut: StageCut) -> str:
    return (
        f"stage {k}: {len(cut.nodes)} node(s), inputs {list(cut.inputs)}, "
        f"outputs {list(cut.outputs)}"
    )


def _specs(names: Sequence[str], types: dict[str, onnx.ValueInfoProto]) -> tuple[TensorSpec, ...]:
    specs = []
    for name in names:
        tensor_type = types[name].type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).str
        if dtype not in DTYPE_TO_DATATYPE:
            raise ExportError(f"tensor {name!r} has a type ({dtype}) shardserve cannot serve")
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
        specs.append(TensorSpec(name=name, datatype=DTYPE_TO_DATATYPE[dtype], shape=shape))
    return tuple(specs)


def _has_batch_dim(names: Sequence[str], types: dict[str, onnx.ValueInfoProto]) -> bool:
    dims = [types[n].type.tensor_type.shape.dim for n in names]
    return all(len(d) > 0 and not d[0].HasField("dim_value") for d in dims)


def _default_name(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem).lstrip(".-") or "model"


def _check_identifiers(layout: SliceLayout) -> None:
    """servable_config.py uses input/output names as Python names; refuse ones that are not."""
    bad = [
        s.name
        for s in (*layout.inputs, *layout.outputs)
        if not s.name.isidentifier() or keyword.iskeyword(s.name)
    ]
    if bad:
        raise ExportError(
            f"input/output names {bad} are not Python identifiers, which "
            f"servable_config.py needs; rename them in the model first"
        )
