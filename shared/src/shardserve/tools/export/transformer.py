"""A GPT-style decoder, exported tensor parallel inside stages and pipelined across them.

Model: ``input_ids`` INT64 [batch, seq] -> token + position embedding -> ``layers`` blocks
of (LayerNorm, causal multi-head self-attention, residual, LayerNorm, MLP with the Erf
form of GELU, residual) -> final LayerNorm -> LM head -> ``logits`` FP32 [batch, seq, vocab].
Positions are ``wpe[0:seq]`` (a Slice bounded by the input's Shape) and the causal mask
compares ``Range(0, seq)`` with itself, so batch and sequence are dynamic
(seq <= max_seq; a longer input fails in onnxruntime with a broadcast error).

Splits. Blocks are spread over ``stage_size`` pipeline stages as evenly as possible (the
first stages take one more when they do not divide); the embedding runs in stage 0, the
final LayerNorm and LM head in the last stage. Stages pass the hidden state
``hidden.<i>`` (input of block i) FP32 [batch, seq, hidden]. Inside a stage of R ranks:

* attention: each rank holds heads/R heads' Q, K, V columns (column parallel) and the
  matching rows of the output projection (row parallel); partial outputs are summed by
  an allreduce, and the projection bias is added once, after it;
* MLP: fc columns and proj rows split the same way, allreduce, bias after;
* embeddings and LayerNorms are replicated;
* LM head: split by vocabulary columns + allgather on the last axis when R divides vocab,
  replicated otherwise.

With R = 1 a stage is one ONNX segment with no collectives.

Shapes, weights (their names, a ``--weights`` file or seeded random ones) and the
block layout are ``shardserve.tools.export.transformer_weights``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from shardserve.repo.repository import AllGatherOp, AllReduceOp, GroupConfig, ProgramOp, RunOp
from shardserve.tools.common import GraphBuilder, split_range
from shardserve.tools.export.transformer_weights import (
    Layout,
    TransformerShape,
    Weights,
    load_weights,
    plan_layout,
    random_weights,
    weight_shapes,
)
from shardserve.tools.quantize.graph import QuantizeSpec
from shardserve.tools.slice_writer import RankSlice, SliceLayout, write_slices
from shardserve.wire.protocol import TensorSpec

Progress = Callable[[str], None]

__all__ = [
    "Layout",
    "TransformerShape",
    "build_rank",
    "export_transformer",
    "load_weights",
    "plan_layout",
    "random_weights",
    "reference_model",
    "weight_shapes",
]

LN_EPSILON = 1e-5
HIDDEN_SHAPE = ("batch", "seq")


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def _i64(value: int) -> np.ndarray:
    return np.array(value, dtype=np.int64)


def hidden_name(block: int) -> str:
    return f"hidden.{block}"


@dataclass
class _StageWriter:
    """Builds one rank's stage as segments separated by collectives."""

    label: str
    ranks: int
    inputs: list[tuple[str, int]]  # (name, onnx elem type) of the current segment
    program: list[ProgramOp] = field(default_factory=list)
    segments: dict[str, onnx.ModelProto] = field(default_factory=dict)
    g: GraphBuilder = field(init=False)

    def __post_init__(self) -> None:
        self.g = GraphBuilder(f"{self.label}_segment0")

    def finish(self, outputs: Sequence[str], last_dims: dict[str, int | str]) -> None:
        """Close the current segment with ``outputs`` ([batch, seq, dim] float tensors)."""
        own = {n for n, _ in self.inputs}
        outs = [n for n in outputs if n not in own]
        file = f"segment{len(self.segments)}.onnx"
        dtypes = dict(self.inputs)
        model = self.g.build(
            inputs=[(n, _shape(n, last_dims)) for n, _ in self.inputs],
            outputs=[(n, _shape(n, last_dims)) for n in outs],
            dtypes=dtypes,
        )
        self.segments[file] = model
        self.program.append(RunOp(file=file))

    def collective(
        self, op: AllReduceOp | AllGatherOp, carry: Sequence[str], last_dims: dict[str, int | str]
    ) -> None:
        """End the segment (outputting ``carry`` + the op's input), run ``op``, restart."""
        self.finish([*carry, op.input], last_dims)
        self.program.append(op)
        self.inputs = [(n, TensorProto.FLOAT) for n in (*carry, op.output)]
        self.g = GraphBuilder(f"{self.label}_segment{len(self.segments)}")


def _shape(name: str, last_dims: dict[str, int | str]) -> list[int | str]:
    if name == "input_ids":
        return list(HIDDEN_SHAPE)
    return [*HIDDEN_SHAPE, last_dims[name]]


class _RankBuilder:
    """Emits one rank's ops for the blocks of its stage."""

    def __init__(
        self, shape: TransformerShape, weights: Weights, layout: Layout, stage: int, local: int
    ) -> None:
        self.shape, self.w, self.layout = shape, weights, layout
        self.stage, self.local = stage, local
        first = layout.blocks[stage].start
        entry = (
            ("input_ids", TensorProto.INT64)
            if stage == 0
            else (hidden_name(first), TensorProto.FLOAT)
        )
        self.out = _StageWriter(f"stage{stage}_rank{local}", layout.ranks, [entry])
        self.dims: dict[str, int | str] = {
            hidden_name(i): shape.hidden for i in range(shape.layers + 1)
        }

    @property
    def g(self) -> GraphBuilder:
        return self.out.g

    def const(self, name: str, value: np.ndarray) -> str:
        return self.g.constant(name, np.ascontiguousarray(value, dtype=np.float32))

    def part(self, total: int) -> slice:
        return split_range(total, self.layout.ranks, self.local)

    def reduce(self, partial: str, result: str, carry: Sequence[str]) -> str:
        """Sum ``partial`` over the stage's ranks (nothing to do with one rank)."""
        if self.layout.ranks == 1:
            return partial
        self.dims[partial] = self.dims[result] = self.shape.hidden
        self.out.collective(AllReduceOp(input=partial, output=result), carry, self.dims)
        return result

    def build(self) -> RankSlice:
        blocks = self.layout.blocks[self.stage]
        h = self.embed() if self.stage == 0 else hidden_name(blocks.start)
        for i in blocks:
            h = self.block(i, h)
        if self.stage == self.layout.stages - 1:
            self.head(h)
        else:
            self.out.finish([h], self.dims)  # h is hidden.<first block of the next stage>
        return RankSlice(tuple(self.out.program), dict(self.out.segments))

    def positions(self, source: str) -> str:
        seq = self.g.op("Shape", source, start=1, end=2)
        seq = self.g.op("Squeeze", seq, self.g.ints("axis0", [0]))
        zero, one = self.g.constant("zero", _i64(0)), self.g.constant("one", _i64(1))
        return self.g.op("Range", zero, seq, one)

    def embed(self) -> str:
        tokens = self.g.op("Gather", self.const("wte", self.w["wte"]), "input_ids")
        # wpe[0:seq] is wpe gathered at Range(0, seq); written as a Slice because
        # onnxruntime's GatherToSlice fusion mis-builds that Gather (ORT 1.2x, "Starts must be
        # a 1-D array").
        seq = self.g.op("Shape", "input_ids", start=1, end=2)
        places = self.g.op(
            "Slice",
            self.const("wpe", self.w["wpe"]),
            self.g.ints("start0", [0]),
            seq,
            self.g.ints("axis0", [0]),
        )
        return self.g.op("Add", tokens, places, out=hidden_name(0))

    def layer_norm(self, x: str, prefix: str) -> str:
        gamma = self.const(f"{prefix}.gamma", self.w[f"{prefix}.gamma"])
        beta = self.const(f"{prefix}.beta", self.w[f"{prefix}.beta"])
        return self.g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=LN_EPSILON)

    def block(self, i: int, h: str) -> str:
        b = f"block{i}"
        attn = self.attention(b, self.layer_norm(h, f"{b}.ln1"))
        attn = self.reduce(attn, f"{b}.attn.sum", carry=[h])
        mid = self.g.op(
            "Add",
            h,
            self.g.op(
                "Add", attn, self.const(f"{b}.attn.proj.bias", self.w[f"{b}.attn.proj.bias"])
            ),
            out=f"{b}.mid",
        )
        self.dims[mid] = self.shape.hidden
        mlp = self.mlp(b, self.layer_norm(mid, f"{b}.ln2"))
        mlp = self.reduce(mlp, f"{b}.mlp.sum", carry=[mid])
        bias = self.const(f"{b}.mlp.proj.bias", self.w[f"{b}.mlp.proj.bias"])
        return self.g.op("Add", mid, self.g.op("Add", mlp, bias), out=hidden_name(i + 1))

    def qkv_weights(self, b: str) -> tuple[np.ndarray, np.ndarray]:
        """This rank's heads' Q, K and V columns, side by side."""
        h, cols = self.shape.hidden, self.part(self.shape.hidden)
        weight, bias = self.w[f"{b}.attn.qkv.weight"], self.w[f"{b}.attn.qkv.bias"]
        picks = [slice(k * h + cols.start, k * h + cols.stop) for k in range(3)]
        return (
            np.concatenate([weight[:, p] for p in picks], axis=1),
            np.concatenate([bias[p] for p in picks]),
        )

    def attention(self, b: str, x: str) -> str:
        g, d = self.g, self.shape.head_dim
        local = self.shape.heads // self.layout.ranks
        weight, bias = self.qkv_weights(b)
        qkv = g.op(
            "Add",
            g.op("MatMul", x, self.const(f"{b}.attn.qkv.weight", weight)),
            self.const(f"{b}.attn.qkv.bias", bias),
        )
        q, k, v = g.op_n("Split", qkv, g.ints("qkv_split", [local * d] * 3), outputs=3, axis=-1)
        heads = g.ints("heads_shape", [0, 0, local, d])
        q = g.op("Transpose", g.op("Reshape", q, heads), perm=[0, 2, 1, 3])
        k = g.op("Transpose", g.op("Reshape", k, heads), perm=[0, 2, 3, 1])
        v = g.op("Transpose", g.op("Reshape", v, heads), perm=[0, 2, 1, 3])
        scale = g.constant("scale", _f32(1.0 / math.sqrt(d)))
        scores = g.op("Mul", g.op("MatMul", q, k), scale)
        scores = g.op("Where", self.future_mask(x), g.constant("neg_inf", _f32(-np.inf)), scores)
        mixed = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        mixed = g.op(
            "Reshape",
            g.op("Transpose", mixed, perm=[0, 2, 1, 3]),
            g.ints("merge_shape", [0, 0, local * d]),
        )
        rows = self.part(self.shape.hidden)
        proj = self.w[f"{b}.attn.proj.weight"][rows, :]
        return g.op(
            "MatMul", mixed, self.const(f"{b}.attn.proj.weight", proj), out=f"{b}.attn.partial"
        )

    def future_mask(self, x: str) -> str:
        """[seq, seq] bool, True where key position > query position (causal)."""
        pos = self.positions(x)
        keys = self.g.op("Unsqueeze", pos, self.g.ints("axis0", [0]))
        queries = self.g.op("Unsqueeze", pos, self.g.ints("axis1", [1]))
        return self.g.op("Greater", keys, queries)

    def mlp(self, b: str, x: str) -> str:
        g, cols = self.g, self.part(4 * self.shape.hidden)
        fc = g.op(
            "MatMul", x, self.const(f"{b}.mlp.fc.weight", self.w[f"{b}.mlp.fc.weight"][:, cols])
        )
        fc = g.op("Add", fc, self.const(f"{b}.mlp.fc.bias", self.w[f"{b}.mlp.fc.bias"][cols]))
        erf = g.op("Erf", g.op("Mul", fc, g.constant("inv_sqrt2", _f32(1 / math.sqrt(2)))))
        gate = g.op("Add", erf, g.constant("one_f", _f32(1.0)))
        gelu = g.op("Mul", g.op("Mul", fc, gate), g.constant("half", _f32(0.5)))
        proj = self.w[f"{b}.mlp.proj.weight"][cols, :]
        return g.op(
            "MatMul", gelu, self.const(f"{b}.mlp.proj.weight", proj), out=f"{b}.mlp.partial"
        )

    def head(self, h: str) -> None:
        x = self.layer_norm(h, "lnf")
        vocab, ranks = self.shape.vocab, self.layout.ranks
        if ranks == 1 or vocab % ranks != 0:
            weight = self.const("lm_head.weight", self.w["lm_head.weight"])
            self.g.op("MatMul", x, weight, out="logits")
            self.dims["logits"] = vocab
            self.out.finish(["logits"], self.dims)
            return
        cols = self.part(vocab)
        weight = self.const("lm_head.weight", self.w["lm_head.weight"][:, cols])
        self.g.op("MatMul", x, weight, out="logits.shard")
        self.dims["logits.shard"] = vocab // ranks
        self.out.finish(["logits.shard"], self.dims)
        self.out.program.append(AllGatherOp(input="logits.shard", output="logits", axis=-1))


def build_rank(shape: TransformerShape, weights: Weights, layout: Layout, rank: int) -> RankSlice:
    """One rank's stage program and segments."""
    return _RankBuilder(shape, weights, layout, rank // layout.ranks, rank % layout.ranks).build()


def reference_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 256,
    max_seq: int = 32,
    seed: int = 0,
    weights: Path | None = None,
) -> onnx.ModelProto:
    """The unsliced model (one rank, one stage) with the same weights as the export."""
    shape = TransformerShape(layers, hidden, heads, vocab, max_seq)
    layout = plan_layout(shape, 1, 1)
    values = load_weights(weights, shape) if weights else random_weights(shape, seed)
    return build_rank(shape, values, layout, 0).segments["segment0.onnx"]


def token_ids_spec(vocab: int, max_seq: int) -> TensorSpec:
    """``input_ids`` [batch, seq]: ids past the vocabulary or sequences past the position table
    would fail inside the agents' Gather/Add, so the signature refuses them up front."""
    return TensorSpec(
        name="input_ids",
        datatype="INT64",
        shape=(-1, -1),
        min_value=0,
        max_value=vocab - 1,
        max_shape=(-1, max_seq),
    )


def export_transformer(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 256,
    max_seq: int = 32,
    rank_size: int = 1,
    stage_size: int = 1,
    seed: int = 0,
    weights: Path | None = None,
    version: int = 1,
    name: str = "transformer",
    progress: Progress | None = None,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write the transformer as servable ``name`` version ``version`` under repository ``out``."""
    shape = TransformerShape(layers, hidden, heads, vocab, max_seq)
    layout = plan_layout(shape, rank_size, stage_size)
    values = load_weights(weights, shape) if weights else random_weights(shape, seed)
    stage_io = tuple(
        (
            ("input_ids",) if s == 0 else (hidden_name(blocks.start),),
            ("logits",) if s == stage_size - 1 else (hidden_name(blocks.stop),),
        )
        for s, blocks in enumerate(layout.blocks)
    )
    plan = SliceLayout(
        servable=name,
        version=version,
        rank_size=rank_size,
        stage_size=stage_size,
        inputs=(token_ids_spec(vocab, max_seq),),
        outputs=(TensorSpec(name="logits", datatype="FP32", shape=(-1, -1, vocab)),),
        stage_io=stage_io,
        with_batch_dim=True,
        origin={
            "model": "transformer",
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "vocab": vocab,
            "max_seq": max_seq,
            "seed": seed if weights is None else -1,
        },
    )
    return write_slices(
        out,
        plan,
        lambda rank: build_rank(shape, values, layout, rank),
        progress,
        quantize=quantize,
    )
