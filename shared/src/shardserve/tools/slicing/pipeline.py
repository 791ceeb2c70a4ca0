"""Cutting any ONNX model into pipeline stages.

A stage is a set of nodes. With explicit ``cuts`` (tensor names t_0 .. t_{S-2}), stage k
holds the nodes needed to compute t_k that are not needed for t_{k-1}; the last stage
holds every remaining node. What is checked, precisely:

* every cut names a tensor some node produces (not a graph input, not an initializer);
* each cut depends on the one before it (t_{k-1} is an ancestor of t_k) -- this refuses
  cuts listed out of topological order and cuts on parallel branches, either of which
  would leave a path around the cut into an earlier stage;
* every stage gets at least one node.

Without ``cuts``, the topologically ordered nodes are split into contiguous runs of about
equal cost (parameter bytes + 4 x FLOPs of MatMul/Gemm/Conv whose shapes are known),
preferring, near each target, the position that carries the fewest tensors across.

Either way, no data flows backwards, and any tensor made in stage <= k and read after
stage k -- a residual, a graph input a later stage needs, a graph output made early -- is
carried: it is an output of stage k and an input of stage k+1, passed through unchanged
by stages that do not use it. Initializers are copied into every stage that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from shardserve.errors import ExportError
from shardserve.tools.slicing.graph import (
    ancestor_nodes,
    consumer_index,
    node_inputs,
    producer_index,
)


@dataclass(frozen=True)
class StageCut:
    """One stage: its nodes (in topological order) and the tensors it reads and writes."""

    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def stage_assignment_from_cuts(
    nodes: Sequence[onnx.NodeProto], cuts: Sequence[str], graph: onnx.GraphProto
) -> list[int]:
    """Stage index of every node, from cut tensor names (see module docstring)."""
    producers = producer_index(nodes)
    graph_inputs = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for cut in cuts:
        if cut not in producers:
            kind = "a graph input or initializer" if cut in graph_inputs else "not in the graph"
            raise ExportError(
                f"cut tensor {cut!r} is {kind}; a cut must name a tensor that a node computes"
            )
    stage = [len(cuts)] * len(nodes)
    previous: set[int] = set()
    for k, cut in enumerate(cuts):
        needed = ancestor_nodes([cut], nodes)
        if not previous < needed:
            raise ExportError(
                f"cut {cut!r} does not depend on the previous cut {cuts[k - 1]!r}: cuts must be "
                f"listed in topological order along the data flow (each computed from the one "
                f"before), otherwise a path would run around the cut"
            )
        for i in needed - previous:
            stage[i] = k
        previous = needed
    if len(previous) == len(nodes):
        raise ExportError(
            f"nothing is left after the last cut {cuts[-1]!r}; the last stage would be empty"
        )
    return stage


def node_cost(node: onnx.NodeProto, sizes: dict[str, int], shapes: dict[str, list[int]]) -> float:
    """Parameter bytes the node reads plus 4 x its multiply-adds when shapes are known."""
    cost = float(sum(sizes.get(n, 0) for n in node.input))
    if node.op_type in ("MatMul", "Gemm", "Conv") and node.output[0] in shapes:
        out = shapes[node.output[0]]
        weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
        if weight and all(d > 0 for d in out):
            reduce = (
                int(np.prod(weight[1:])) if node.op_type == "Conv" else _inner_dim(node, weight)
            )
            cost += 4.0 * float(np.prod(out)) * reduce
    return cost


def _inner_dim(node: onnx.NodeProto, weight: list[int]) -> int:
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        return weight[-1]
    return weight[-2] if len(weight) >= 2 else weight[0]


def balanced_assignment(
    nodes: Sequence[onnx.NodeProto], stages: int, costs: Sequence[float]
) -> list[int]:
    """Contiguous runs of about equal cost; near each target, the fewest carried tensors."""
    if len(nodes) < stages:
        raise ExportError(f"the model has {len(nodes)} nodes; it cannot fill {stages} stages")
    prefix = np.cumsum([0.0, *costs])
    total = prefix[-1] if prefix[-1] > 0 else 1.0
    crossing = _crossing_counts(nodes)
    bounds = [0]
    for k in range(1, stages):
        target = total * k / stages
        low, high = bounds[-1] + 1, len(nodes) - (stages - k)
        window = total / (4 * stages)
        near = [p for p in range(low, high + 1) if abs(prefix[p] - target) <= window]
        if near:
            best = min(near, key=lambda p: (crossing[p], abs(prefix[p] - target), -p))
        else:
            best = min(range(low, high + 1), key=lambda p: (abs(prefix[p] - target), -p))
        bounds.append(best)
    bounds.append(len(nodes))
    return [k for k in range(stages) for _ in range(bounds[k], bounds[k + 1])]


def _crossing_counts(nodes: Sequence[onnx.NodeProto]) -> list[int]:
    """For each position p, how many node outputs made before p are read at or after p."""
    producers = producer_index(nodes)
    last_use = {name: max(uses) for name, uses in consumer_index(nodes).items()}
    delta = [0] * (len(nodes) + 2)
    for name, made in producers.items():
        end = last_use.get(name, made)
        if end > made:
            delta[made + 1] += 1
            delta[end + 1] -= 1
    counts, running = [], 0
    for p in range(len(nodes) + 1):
        running += delta[p]
        counts.append(running)
    return counts


def build_stages(
    nodes: Sequence[onnx.NodeProto],
    assignment: Sequence[int],
    graph_inputs: Sequence[str],
    graph_outputs: Sequence[str],
    initializers: set[str],
) -> list[StageCut]:
    """Stage inputs/outputs from a node -> stage assignment, carrying skipping tensors."""
    count = max(assignment) + 1
    made_in = {out: assignment[i] for i, node in enumerate(nodes) for out in node.output if out}
    made_in.update({name: -1 for name in graph_inputs})
    last_need: dict[str, int] = {name: count for name in graph_outputs}
    for i, node in enumerate(nodes):
        for name in node_inputs(node):
            if name in made_in:
                last_need[name] = max(last_need.get(name, -1), assignment[i])
    cuts: list[StageCut] = []
    for k in range(count):
        members = tuple(n for n, s in zip(nodes, assignment, strict=True) if s == k)
        ins = tuple(graph_inputs) if k == 0 else cuts[-1].outputs
        if k == count - 1:
            outs = tuple(graph_outputs)
        else:
            outs = tuple(n for n in made_in if made_in[n] <= k < last_need.get(n, -1))
        cuts.append(StageCut(members, ins, outs))
    _check_closed(cuts, initializers)
    return cuts


def _check_closed(cuts: Sequence[StageCut], initializers: set[str]) -> None:
    """Every tensor a stage reads is a stage input, an initializer or made in the stage."""
    for k, cut in enumerate(cuts):
        known = set(cut.inputs) | initializers
        for node in cut.nodes:
            missing = [n for n in node_inputs(node) if n not in known]
            if missing:
                raise ExportError(
                    f"stage {k}: node {node.name or node.op_type!r} reads "
                    f"{missing}, which no earlier stage provides"
                )
            known.update(node.output)
        absent = [n for n in cut.outputs if n not in known]
        if absent:
            raise ExportError(f"stage {k}: outputs {absent} are not computed by this stage")
