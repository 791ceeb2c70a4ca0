"""Rewriting a stage's nodes for one rank of a tensor-parallel stage, and cutting the
result into ONNX segments around its collectives.

A stage becomes a list of items: ONNX nodes and collectives (AllReduceOp/AllGatherOp).
``segments`` turns that list into the stage program: each maximal run of nodes is one
segment whose inputs are what it reads from the stage environment and whose outputs are
what later items (or the stage's outputs) read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from shardserve.repo.repository import AllGatherOp, AllReduceOp, ProgramOp, RunOp
from shardserve.tools.slicing.graph import node_inputs, segment_model
from shardserve.tools.slicing.megatron import Lone, Pair, ShardingPlan

Item = onnx.NodeProto | AllReduceOp | AllGatherOp


@dataclass(frozen=True)
class RankStage:
    """A stage as one rank runs it: items in order and this rank's initializers."""

    items: tuple[Item, ...]
    inits: dict[str, onnx.TensorProto]
    types: dict[str, onnx.ValueInfoProto]


def shard_stage(
    nodes: Sequence[onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
    types: dict[str, onnx.ValueInfoProto],
    plan: ShardingPlan,
    ranks: int,
    rank: int,
) -> RankStage:
    """The stage for ``rank`` of ``ranks``: sliced weights, renamed outputs, collectives."""
    rewrite = _RankRewrite(nodes, dict(inits), dict(types), ranks, rank)
    for pair in plan.pairs:
        _shard_pair(rewrite, pair)
    for lone in plan.lones:
        _shard_lone(rewrite, lone)
    return RankStage(rewrite.items(), rewrite.inits, rewrite.types)


@dataclass
class _RankRewrite:
    """One rank's rewrite of a stage, under way: the stage's nodes, this rank's own copies
    of the initializers and value types (sliced and retyped in place), the nodes replaced
    and the items inserted after a node, both by node index."""

    nodes: Sequence[onnx.NodeProto]
    inits: dict[str, onnx.TensorProto]
    types: dict[str, onnx.ValueInfoProto]
    ranks: int
    rank: int
    replaced: dict[int, onnx.NodeProto] = field(default_factory=dict)
    after: dict[int, list[Item]] = field(default_factory=dict)

    def items(self) -> tuple[Item, ...]:
        """The stage's items in order: each node (or its replacement), then its insertions."""
        items: list[Item] = []
        for i, node in enumerate(self.nodes):
            items.append(self.replaced.get(i, node))
            items.extend(self.after.get(i, []))
        return tuple(items)


def _slice(tensor: onnx.TensorProto, axis: int, ranks: int, rank: int) -> onnx.TensorProto:
    array = numpy_helper.to_array(tensor)
    share = array.shape[axis] // ranks
    index = [slice(None)] * array.ndim
    index[axis] = slice(rank * share, (rank + 1) * share)
    return numpy_helper.from_array(np.ascontiguousarray(array[tuple(index)]), tensor.name)


def _trans_b(node: onnx.NodeProto) -> bool:
    return any(a.name == "transB" and a.i for a in node.attribute)


def _split_columns(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], ranks: int, rank: int, width: int
) -> None:
    """Column-split the weight (and a Gemm bias) of ``node`` in ``inits``."""
    weight = node.input[1]
    inits[weight] = _slice(inits[weight], 0 if _trans_b(node) else 1, ranks, rank)
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        _split_bias(inits, node.input[2], width, ranks, rank)


def _split_bias(
    inits: dict[str, onnx.TensorProto], name: str, width: int, ranks: int, rank: int
) -> None:
    dims = list(inits[name].dims)
    if dims and dims[-1] == width:
        inits[name] = _slice(inits[name], len(dims) - 1, ranks, rank)


def _renamed(node: onnx.NodeProto, output: str, drop_bias: bool = False) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.output[0] = output
    if drop_bias:
        del copy.input[2:]
    return copy


def _retype(
    types: dict[str, onnx.ValueInfoProto], source: str, name: str, free_last: bool = False
) -> None:
    """Type ``name`` like ``source``; ``free_last`` makes the last dim unknown (a shard)."""
    if source not in types:
        return
    info = onnx.ValueInfoProto()
    info.CopyFrom(types[source])
    info.name = name
    dims = info.type.tensor_type.shape.dim
    if free_last and len(dims) > 0:
        dims[-1].Clear()
    types[name] = info


def _shard_pair(rewrite: _RankRewrite, pair: Pair) -> None:
    inits, ranks, rank = rewrite.inits, rewrite.ranks, rewrite.rank
    _split_columns(rewrite.nodes[pair.first], inits, ranks, rank, pair.width)
    for bias in pair.biases:
        _split_bias(inits, bias, pair.width, ranks, rank)
    second = rewrite.nodes[pair.second]
    inits[second.input[1]] = _slice(
        inits[second.input[1]], 1 if _trans_b(second) else 0, ranks, rank
    )
    out = second.output[0]
    partial = f"{out}.partial"
    has_bias = second.op_type == "Gemm" and len(second.input) > 2 and bool(second.input[2])
    rewrite.replaced[pair.second] = _renamed(second, partial, drop_bias=has_bias)
    _retype(rewrite.types, out, partial)
    if not has_bias:
        rewrite.after[pair.second] = [AllReduceOp(input=partial, output=out)]
        return
    summed = f"{out}.sum"
    _retype(rewrite.types, out, summed)
    bias = _scaled_bias(second, inits)
    add = helper.make_node("Add", [summed, bias], [out], f"{second.name or out}.bias_after_sum")
    rewrite.after[pair.second] = [AllReduceOp(input=partial, output=summed), add]


def _scaled_bias(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> str:
    """The Gemm bias times beta, as an initializer name (the bias itself when beta is 1)."""
    name = node.input[2]
    beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
    if beta == 1.0:
        return name
    array = numpy_helper.to_array(inits[name])
    scaled = f"{name}.beta_scaled"
    inits[scaled] = numpy_helper.from_array((array * np.float32(beta)).astype(array.dtype), scaled)
    return scaled


def _shard_lone(rewrite: _RankRewrite, lone: Lone) -> None:
    node = rewrite.nodes[lone.index]
    _split_columns(node, rewrite.inits, rewrite.ranks, rewrite.rank, lone.width)
    out = node.output[0]
    shard = f"{out}.shard"
    rewrite.replaced[lone.index] = _renamed(node, shard)
    _retype(rewrite.types, out, shard, free_last=True)
    rewrite.after[lone.index] = [AllGatherOp(input=shard, output=out, axis=-1)]


def segments(
    source: onnx.ModelProto,
    stage: RankStage,
    stage_outputs: Sequence[str],
    label: str,
) -> tuple[tuple[ProgramOp, ...], dict[str, onnx.ModelProto]]:
    """The stage program and its segment models for one rank."""
    runs = _runs(stage.items)
    program: list[ProgramOp] = []
    models: dict[str, onnx.ModelProto] = {}
    for position, run in enumerate(runs):
        if not isinstance(run, list):
            program.append(run)
            continue
        later = _read_later(runs[position + 1 :], stage_outputs)
        made = [out for node in run for out in node.output if out]
        reads = [n for node in run for n in node_inputs(node)]
        made_set = set(made)
        inputs = [n for n in dict.fromkeys(reads) if n not in made_set and n not in stage.inits]
        outputs = [n for n in made if n in later]
        file = f"segment{len(models)}.onnx"
        models[file] = segment_model(
            source, run, inputs, outputs, stage.inits, stage.types, f"{label}_segment{len(models)}"
        )
        program.append(RunOp(file=file))
    return tuple(program), models


def _runs(items: Sequence[Item]) -> list[list[onnx.NodeProto] | AllReduceOp | AllGatherOp]:
    """Group consecutive nodes into lists; collectives stay single items."""
    runs: list[list[onnx.NodeProto] | AllReduceOp | AllGatherOp] = []
    for item in items:
        if isinstance(item, onnx.NodeProto):
            if runs and isinstance(runs[-1], list):
                runs[-1].append(item)
            else:
                runs.append([item])
        else:
            runs.append(item)
    return runs


def _read_later(
    runs: Sequence[list[onnx.NodeProto] | AllReduceOp | AllGatherOp], stage_outputs: Sequence[str]
) -> set[str]:
    names = set(stage_outputs)
    for run in runs:
        if isinstance(run, list):
            names.update(n for node in run for n in node_inputs(node))
        else:
            names.add(run.input)
    return names
