"""Deterministic ONNX building for the exporters: ``GraphBuilder`` and the pinned model
wrapper. Exported files are byte-for-byte reproducible: opset and IR version are pinned,
the producer is fixed, node names are counters, serialization is deterministic."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shardserve.errors import ExportError

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17; every onnxruntime >= 1.13 reads it
PRODUCER_NAME = "shardserve.export"
PRODUCER_VERSION = "1"  # bumped only when exported bytes change on purpose
MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops (fused norms, rotary)
Shape = Sequence[int | str]  # str = a named dynamic dimension (ONNX dim_param)


@dataclass
class GraphBuilder:
    """Builds one ONNX graph with deterministic node and tensor names.

    ``op`` returns the name of its (first) output, so graphs read like expressions::

        g = GraphBuilder("seg0")
        h = g.op("MatMul", "x", g.constant("w", weight))
        g.op("Neg", h, out="y")
        model = g.build(inputs=[("x", [128, 96])], outputs=[("y", [128, 16])])
    """

    name: str
    _nodes: list[onnx.NodeProto] = field(default_factory=list)
    _initializers: list[onnx.TensorProto] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)

    def fresh(self, hint: str) -> str:
        """A tensor name not used yet in this graph (hint, hint_1, hint_2...)."""
        candidate, n = hint, 0
        while candidate in self._names:
            n += 1
            candidate = f"{hint}_{n}"
        self._names.add(candidate)
        return candidate

    def constant(self, hint: str, value: np.ndarray) -> str:
        """Add an initializer (weights, slice bounds...); returns its name."""
        name = self.fresh(hint)
        self._initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def ints(self, hint: str, values: Sequence[int]) -> str:
        return self.constant(hint, np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        """Append one node; returns its output name (``out`` or a fresh one)."""
        output = out if out is not None else self.fresh(op_type.lower())
        if out is not None:
            self._names.add(out)
        node_name = f"{op_type}_{len(self._nodes)}"
        self._nodes.append(helper.make_node(op_type, list(inputs), [output], node_name, **attrs))
        return output

    def op_n(
        self,
        op_type: str,
        *inputs: str,
        outputs: int | Sequence[str | None],
        **attrs: Any,
    ) -> list[str]:
        """Append one node with several outputs (Split, TopK...); returns their names.
        ``outputs``: how many (fresh names), or each output's name (None: a fresh one,
        "": an optional output left out)."""
        wanted = [None] * outputs if isinstance(outputs, int) else list(outputs)
        names = [
            self.fresh(f"{op_type.lower()}_out{i}") if n is None else n
            for i, n in enumerate(wanted)
        ]
        self._names.update(n for n in names if n)
        node_name = f"{op_type}_{len(self._nodes)}"
        self._nodes.append(helper.make_node(op_type, list(inputs), names, node_name, **attrs))
        return names

    def slice_axis(self, source: str, axis: int, part: slice, out: str | None = None) -> str:
        """``source[..., part, ...]`` along ``axis`` (a Slice node with constant bounds)."""
        starts = self.ints("starts", [part.start])
        ends = self.ints("ends", [part.stop])
        axes = self.ints("axes", [axis])
        return self.op("Slice", source, starts, ends, axes, out=out)

    def build(
        self,
        inputs: Sequence[tuple[str, Shape]],
        outputs: Sequence[tuple[str, Shape]],
        dtypes: Mapping[str, int] | None = None,
    ) -> onnx.ModelProto:
        """The finished model, checked by onnx (including shape inference). Graph inputs
        and outputs are float32 unless ``dtypes`` maps their name to an ONNX elem type."""
        types = dtypes or {}

        def info(name: str, shape: Shape) -> onnx.ValueInfoProto:
            elem = types.get(name, TensorProto.FLOAT)
            return helper.make_tensor_value_info(name, elem, list(shape))

        graph = helper.make_graph(
            self._nodes,
            self.name,
            [info(n, s) for n, s in inputs],
            [info(n, s) for n, s in outputs],
            initializer=self._initializers,
        )
        return finish_model(graph)


def finish_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """Wrap a graph with the pinned opset/IR/producer and check it."""
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in _opsets(graph)],
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
        ir_version=IR_VERSION,
    )
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"exported graph {graph.name!r} is not valid ONNX: {exc}") from exc
    return model


def _opsets(graph: onnx.GraphProto) -> list[tuple[str, int]]:
    """The pinned default opset, and onnxruntime's contrib domain when a node uses it."""
    domains = {node.domain for node in graph.node}
    return [("", OPSET)] + ([(MS_DOMAIN, 1)] if MS_DOMAIN in domains else [])


def model_bytes(model: onnx.ModelProto) -> bytes:
    """Deterministic serialization (same model -> same bytes, run after run)."""
    return model.SerializeToString(deterministic=True)
