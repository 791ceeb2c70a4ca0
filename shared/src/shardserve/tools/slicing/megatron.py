"""Finding what can be split across the ranks of a stage, Megatron style.

Only these patterns are sharded, everything else is replicated (and reported as such):

* pair: ``MatMul/Gemm(x, W1)`` -> elementwise ops only (Add/Sub/Mul/Div with a bias or a
  scalar, Relu, Gelu, Erf, Tanh, Sigmoid, ... -- e.g. the Erf form of GELU) ->
  ``MatMul/Gemm(., W2)``. W1 is split by columns and its bias with it (column parallel),
  W2 by rows (row parallel); the partial products are summed by an allreduce, and a
  Gemm bias of W2 is added once, after the allreduce.
* lone: any other ``MatMul/Gemm(x, W)``: W split by columns, outputs gathered along the
  last axis (allgather).

W must be a 2-D initializer read by that node alone (a Gemm must have transA=0), and the
split dimension must be divisible by the ranks. Tensors inside a pair must not leave it
(no other reader, not a stage output), since they only exist as shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
from onnx import numpy_helper

from shardserve.tools.slicing.graph import consumer_index, node_inputs

ELEMENTWISE_UNARY = frozenset(
    {
        "Relu",
        "Gelu",
        "Erf",
        "Tanh",
        "Sigmoid",
        "Neg",
        "Abs",
        "Exp",
        "Softplus",
        "Identity",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Celu",
        "HardSigmoid",
        "HardSwish",
        "Sqrt",
        "Reciprocal",
    }
)
ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


@dataclass(frozen=True)
class Pair:
    """Column-parallel ``first``, elementwise ``region``, row-parallel ``second``."""

    first: int
    region: tuple[int, ...]
    second: int
    width: int  # the split dimension (columns of W1 = rows of W2)
    biases: tuple[str, ...]  # initializers inside the pair sliced along the last axis


@dataclass(frozen=True)
class Lone:
    """Column-parallel node whose output shards are gathered on the last axis."""

    index: int
    width: int


@dataclass
class ShardingPlan:
    pairs: list[Pair] = field(default_factory=list)
    lones: list[Lone] = field(default_factory=list)
    report: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Facts:
    nodes: Sequence[onnx.NodeProto]
    inits: dict[str, onnx.TensorProto]
    consumers: dict[str, list[int]]
    kept: frozenset[str]  # tensors read outside the stage's nodes (stage outputs)


def plan_sharding(
    nodes: Sequence[onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
    stage_outputs: Sequence[str],
    ranks: int,
    label: str,
) -> ShardingPlan:
    """Decide, node by node, what is split how; ``report`` says it in plain words."""
    facts = _Facts(nodes, inits, consumer_index(nodes), frozenset(stage_outputs))
    plan = ShardingPlan()
    claimed: set[int] = set()
    for i, node in enumerate(nodes):
        if i in claimed or node.op_type not in ("MatMul", "Gemm"):
            continue
        name = f"{label} {node.op_type} {node.name or node.output[0]!r}"
        why = _weight_problem(facts, i)
        if why:
            plan.report.append(f"{name}: replicated ({why})")
            continue
        width = _columns(facts, i)
        pair = _find_pair(facts, i, claimed)
        if isinstance(pair, Pair) and width % ranks == 0:
            plan.pairs.append(pair)
            claimed.update({pair.first, pair.second, *pair.region})
            second = nodes[pair.second]
            plan.report.append(
                f"{name}: column-parallel over {ranks} ranks ({width} columns -> {width // ranks} "
                f"each), {len(pair.region)} elementwise node(s), then {second.op_type} "
                f"{second.name or second.output[0]!r}: row-parallel + allreduce-sum"
            )
        elif width % ranks == 0:
            plan.lones.append(Lone(i, width))
            claimed.add(i)
            reason = f"; not a pair: {pair}" if isinstance(pair, str) else ""
            plan.report.append(
                f"{name}: column-parallel over {ranks} ranks + allgather on the last axis{reason}"
            )
        else:
            plan.report.append(f"{name}: replicated ({width} columns not divisible by {ranks})")
    return plan


def _weight_problem(facts: _Facts, i: int) -> str:
    """Why node i's weight cannot be split, or '' when it can."""
    node = facts.nodes[i]
    if len(node.input) < 2 or node.input[1] not in facts.inits:
        return "its weight is not an initializer"
    if len(facts.inits[node.input[1]].dims) != 2:
        return "its weight is not 2-D"
    if len(facts.consumers.get(node.input[1], [])) != 1:
        return "its weight is shared with other nodes"
    if node.op_type == "Gemm" and _attr(node, "transA", 0):
        return "Gemm with transA=1 is not supported"
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        if not _sliceable_bias(facts, node.input[2], _columns(facts, i)):
            return "its Gemm bias has a shape that cannot follow a column split"
    return ""


def _columns(facts: _Facts, i: int) -> int:
    """Output columns of a MatMul/Gemm (the dimension a column split divides)."""
    node = facts.nodes[i]
    dims = list(facts.inits[node.input[1]].dims)
    return dims[0] if node.op_type == "Gemm" and _attr(node, "transB", 0) else dims[1]


def _rows(facts: _Facts, i: int) -> int:
    node = facts.nodes[i]
    dims = list(facts.inits[node.input[1]].dims)
    return dims[1] if node.op_type == "Gemm" and _attr(node, "transB", 0) else dims[0]


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _sliceable_bias(facts: _Facts, name: str, width: int) -> bool:
    """A bias that is exclusive to its node and whose last dim is ``width`` (or 1)."""
    if name not in facts.inits or len(facts.consumers.get(name, [])) != 1:
        return False
    dims = list(facts.inits[name].dims)
    return not dims or dims[-1] in (1, width)


def _find_pair(facts: _Facts, first: int, claimed: set[int]) -> Pair | str:
    """The pair starting at ``first``, or a sentence saying why there is none. Nodes are
    visited in topological order, so a node's region inputs are known when it is checked."""
    width = _columns(facts, first)
    inside = {facts.nodes[first].output[0]}
    region: list[int] = []
    biases: list[str] = []
    second: int | None = None
    for j in range(first + 1, len(facts.nodes)):
        node = facts.nodes[j]
        if not inside.intersection(node_inputs(node)):
            continue
        if second is not None:
            return f"{node.op_type} {node.name!r} reads the pair's inner tensors"
        if node.op_type in ("MatMul", "Gemm") and j not in claimed and node.input[0] in inside:
            if _weight_problem(facts, j) or _rows(facts, j) != width:
                return f"{node.op_type} {node.name!r} cannot be split by rows"
            second = j
            continue
        problem = _elementwise_problem(facts, node, inside, width, biases)
        if problem:
            return problem
        region.append(j)
        inside.update(node.output)
    leaving = sorted(inside & facts.kept)
    if leaving:
        return f"{leaving} leave the stage"
    if second is None:
        return "no second matrix product follows"
    return Pair(first, tuple(region), second, width, tuple(biases))


def _elementwise_problem(
    facts: _Facts, node: onnx.NodeProto, inside: set[str], width: int, biases: list[str]
) -> str:
    if node.op_type not in ELEMENTWISE_UNARY | ELEMENTWISE_BINARY or len(node.output) != 1:
        return f"{node.op_type} {node.name!r} is not an elementwise op"
    for name in node_inputs(node):
        if name in inside:
            continue
        if name not in facts.inits:
            return f"{node.op_type} {node.name!r} reads {name!r}, which is not a constant"
        dims = list(facts.inits[name].dims)
        if numpy_helper.to_array(facts.inits[name]).size == 1:
            continue
        if not _sliceable_bias(facts, name, width) or dims[-1] != width:
            return (
                f"{node.op_type} {node.name!r} reads {name!r}, which is not a bias of width {width}"
            )
        biases.append(name)
    return ""
