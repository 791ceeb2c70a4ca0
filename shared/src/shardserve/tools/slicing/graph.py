"""Graph facts the slicers need: who produces and consumes each tensor, topological
order, ancestors, tensor types, and cutting a node subset out as its own model.

Nodes are addressed by their index in the (topologically ordered) node list. A node
with subgraphs (If, Loop, Scan) also reads the outer-scope tensors its subgraphs name;
``node_inputs`` reports those, so such a node is never separated from what it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import helper

from shardserve.errors import ExportError


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads: its inputs plus outer-scope names used by its subgraphs."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            names.extend(n for n in _outer_names(sub) if n not in names)
    return names


def _outer_names(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads but does not define itself (outer-scope references)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    outer: list[str] = []
    for node in graph.node:
        for name in node_inputs(node):
            if name not in defined and name not in outer:
                outer.append(name)
        defined.update(node.output)
    outer.extend(o.name for o in graph.output if o.name not in defined and o.name not in outer)
    return outer


def producer_index(nodes: Sequence[onnx.NodeProto]) -> dict[str, int]:
    """Tensor name -> index of the node that produces it."""
    return {out: i for i, node in enumerate(nodes) for out in node.output if out}


def consumer_index(nodes: Sequence[onnx.NodeProto]) -> dict[str, list[int]]:
    """Tensor name -> indices of the nodes that read it, ascending."""
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node_inputs(node):
            consumers.setdefault(name, []).append(i)
    return consumers


def topological_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes in a topological order (the stored order when it already is one)."""
    nodes = list(graph.node)
    producers = producer_index(nodes)
    pending = {
        i: {producers[n] for n in node_inputs(node) if n in producers}
        for i, node in enumerate(nodes)
    }
    ordered: list[int] = []
    done: set[int] = set()
    while len(ordered) < len(nodes):
        ready = [i for i in range(len(nodes)) if i not in done and pending[i] <= done]
        if not ready:
            raise ExportError("the graph has a cycle; it cannot be cut into stages")
        ordered.extend(ready)
        done.update(ready)
    return [nodes[i] for i in ordered]


def ancestor_nodes(names: Iterable[str], nodes: Sequence[onnx.NodeProto]) -> set[int]:
    """Indices of every node needed to compute ``names`` (their producers, transitively)."""
    producers = producer_index(nodes)
    found: set[int] = set()
    stack = [producers[n] for n in names if n in producers]
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        stack.extend(producers[n] for n in node_inputs(nodes[i]) if n in producers)
    return found


def value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Name -> ValueInfo (type and shape) of every tensor onnx shape inference can type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ExportError(f"onnx shape inference failed on the model: {exc}") from exc
    graph = inferred.graph
    infos = [*graph.input, *graph.value_info, *graph.output]
    types = {v.name: v for v in infos if v.type.HasField("tensor_type")}
    for tensor in graph.initializer:
        types.setdefault(
            tensor.name,
            helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)),
        )
    return types


def typed(name: str, types: dict[str, onnx.ValueInfoProto]) -> onnx.ValueInfoProto:
    """The ValueInfo of ``name``; refuses a tensor whose element type is unknown."""
    info = types.get(name)
    if info is None or info.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED:
        raise ExportError(
            f"cannot tell the type of tensor {name!r}, which crosses a cut; run onnx shape "
            f"inference on the model (or add value_info for it) first"
        )
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(info)
    return copy


def segment_model(
    source: onnx.ModelProto,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[str],
    outputs: Sequence[str],
    initializers: dict[str, onnx.TensorProto],
    types: dict[str, onnx.ValueInfoProto],
    name: str,
) -> onnx.ModelProto:
    """A model of ``nodes`` reading ``inputs`` and writing ``outputs``; it carries only the
    initializers its nodes use. Opsets and IR version are those of ``source``."""
    used = [n for node in nodes for n in node_inputs(node)]
    inits = [initializers[n] for n in dict.fromkeys(used) if n in initializers]
    graph = helper.make_graph(
        list(nodes),
        name,
        [typed(n, types) for n in inputs],
        [typed(n, types) for n in outputs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=list(source.opset_import))
    model.ir_version = source.ir_version
    model.producer_name = "shardserve.slicing"
    model.producer_version = "1"
    model.functions.extend(source.functions)
    return model
