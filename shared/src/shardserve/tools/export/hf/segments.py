"""One rank's stage program under construction: ONNX segments cut at every op that is not
ONNX (collectives, attention).

Tensors crossing a cut are registered with their shape (``declare``); a segment's graph
inputs are the registered tensors it reads (``take``) that earlier segments or the stage
inputs produced, its outputs are those a later op reads. Rows are packed tokens:
dimension ``tokens`` (N) for every per-token tensor, ``rows`` (M) for the logit rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from shardserve.repo.repository import AllGatherOp, AllReduceOp, AttentionOp, ProgramOp, RunOp
from shardserve.tools.onnx_graph import GraphBuilder, Shape
from shardserve.tools.quantize import QuantizedBlocks

__all__ = ["ProgramWriter", "SegmentSink"]

# (file name, segment, its weights quantized at the source by initializer name)
SegmentSink = Callable[[str, onnx.ModelProto, Mapping[str, QuantizedBlocks]], None]


@dataclass
class ProgramWriter:
    label: str
    # Receives each finished segment; the exporter writes it to disk at once, so a rank's
    # segments are never all in memory. Without a sink they are kept in ``segments``.
    sink: SegmentSink | None = None
    program: list[ProgramOp] = field(default_factory=list)
    segments: dict[str, onnx.ModelProto] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    # this segment's initializers that the source holds quantized (for the sink's quantize)
    blocks: dict[str, QuantizedBlocks] = field(default_factory=dict)
    _specs: dict[str, tuple[int, Shape]] = field(default_factory=dict)
    _inputs: list[str] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)  # declared tensors made in this segment
    # declared tensors every cut hands on (the stage's rotary tables, read by every layer)
    carried: list[str] = field(default_factory=list)
    g: GraphBuilder = field(init=False)

    def __post_init__(self) -> None:
        self.g = GraphBuilder(f"{self.label}_segment0")

    def declare(self, name: str, shape: Shape, elem: int = TensorProto.FLOAT) -> str:
        self._specs[name] = (elem, shape)
        return name

    def take(self, name: str) -> str:
        """A declared tensor read here: a graph input unless this segment made it."""
        if name not in self._made and name not in self._inputs:
            self._inputs.append(name)
        return name

    def make(self, op_type: str, *inputs: str, out: str, **attrs: object) -> str:
        """A node whose output is a declared tensor (one that may cross a cut)."""
        self._made.append(out)
        return self.g.op(op_type, *inputs, out=out, **attrs)

    def make_n(
        self, op_type: str, *inputs: str, outputs: Sequence[str | None], **attrs: object
    ) -> list[str]:
        """A node with several outputs, the declared tensors among them named in
        ``outputs`` (None: a fresh name, "": an optional output left out)."""
        self._made.extend(n for n in outputs if n and n in self._specs)
        return self.g.op_n(op_type, *inputs, outputs=outputs, **attrs)

    def close(self, outputs: Sequence[str]) -> None:
        """End the segment; ``outputs`` are what later ops read (inputs pass through env)."""
        if not self._made and not self._inputs:
            return
        outs = [n for n in dict.fromkeys([*outputs, *self.carried]) if n in self._made]
        model = self.g.build(
            inputs=[(n, self._specs[n][1]) for n in self._inputs],
            outputs=[(n, self._specs[n][1]) for n in outs],
            dtypes={n: self._specs[n][0] for n in (*self._inputs, *outs)},
        )
        file = f"segment{len(self.files)}.onnx"
        if self.sink is None:
            self.segments[file] = model
        else:
            self.sink(file, model, self.blocks)
        self.files.append(file)
        self.program.append(RunOp(file=file))
        self._inputs, self._made, self.blocks = [], [], {}
        self.g = GraphBuilder(f"{self.label}_segment{len(self.files)}")

    def cut(self, op: AllReduceOp | AllGatherOp | AttentionOp, carry: Sequence[str]) -> None:
        """Close the segment before ``op`` (outputting its inputs and ``carry``), append it."""
        reads = [op.q, op.k, op.v] if isinstance(op, AttentionOp) else [op.input]
        self.close([*reads, *carry])
        self.program.append(op)
