"""A Megatron-style residual MLP: y = x + fc2(gelu(fc1(x))) per block, blocks in sequence.

Inside a stage, fc1 is column-parallel (each rank holds its ffn columns of W1 and b1, and
applies GELU to them) and fc2 row-parallel (the matching W2 rows give a partial sum); an
allreduce-sum joins the partials, then the next segment adds b2 once and the residual.
Blocks are spread over pipeline stages as evenly as possible (earlier stages take the
extra ones); each stage hands the full hidden state [batch, hidden] to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from shardserve.errors import ExportError
from shardserve.repo.repository import AllReduceOp, GroupConfig, ProgramOp, RunOp, sha256_file
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

BATCH = "batch"  # the dynamic batch dimension of x and y
WEIGHT_SCALE = 0.02
Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class MlpShape:
    hidden: int
    ffn: int
    layers: int

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight name the network needs (the ``.npz`` names) and its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(self.layers):
            shapes[f"block{i}.fc1.weight"] = (self.hidden, self.ffn)
            shapes[f"block{i}.fc1.bias"] = (self.ffn,)
            shapes[f"block{i}.fc2.weight"] = (self.ffn, self.hidden)
            shapes[f"block{i}.fc2.bias"] = (self.hidden,)
        return shapes


def export_mlp(
    out: Path,
    *,
    hidden: int = 1024,
    ffn: int = 4096,
    layers: int = 2,
    rank_size: int = 1,
    stage_size: int = 1,
    seed: int = 0,
    weights: Path | None = None,
    version: int = 1,
    name: str = "mlp",
    progress: Progress | None = None,
    overwrite: bool = False,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write the MLP servable into the repository ``out``, cut for ``rank_size`` ranks.

    Weights come from ``weights`` (an ``.npz`` with ``block{i}.fc1.weight`` [hidden, ffn],
    ``block{i}.fc1.bias`` [ffn], ``block{i}.fc2.weight`` [ffn, hidden], ``block{i}.fc2.bias``
    [hidden] for i < layers, nothing else), or else ``numpy.random.default_rng(seed)``
    normals times 0.02. x and y are FP32 [-1, hidden] (dynamic batch, with_batch_dim=True).
    """
    shape = MlpShape(hidden, ffn, layers)
    parts = _check_arguments(shape, rank_size, stage_size)
    params = load_weights(weights, shape) if weights is not None else random_weights(seed, shape)
    blocks = stage_blocks(layers, stage_size)
    plan = ExportPlan(
        servable=name,
        version=version,
        rank_size=rank_size,
        stage_size=stage_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, hidden)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(-1, hidden)),),
        stages=tuple(_stage_plan(b, layers, parts) for b in blocks),
        with_batch_dim=True,
        max_batch_size=0,
        origin={
            "exporter": "shardserve.export.mlp",
            "hidden": hidden,
            "ffn": ffn,
            "layers": layers,
            "rank_size": rank_size,
            "stage_size": stage_size,
            "seed": seed,
            "weights": "random" if weights is None else f"npz sha256 {sha256_file(weights)}",
        },
    )

    def segments_for_rank(rank: int) -> dict[str, onnx.ModelProto]:
        stage, index = divmod(rank, parts)
        return _stage_segments(params, shape, blocks[stage], parts, index, rank)

    return write_version(
        out, plan, segments_for_rank, progress, overwrite=overwrite, quantize=quantize
    )


def reference_model(
    *,
    hidden: int = 1024,
    ffn: int = 4096,
    layers: int = 2,
    seed: int = 0,
    weights: Path | None = None,
) -> onnx.ModelProto:
    """The unsliced network with the same weights as ``export_mlp`` with these arguments."""
    shape = MlpShape(hidden, ffn, layers)
    _check_sizes(shape)
    params = load_weights(weights, shape) if weights is not None else random_weights(seed, shape)
    g = GraphBuilder("mlp")
    for i in range(layers):
        h = _hidden_name(i, layers)
        partial = _block_partial(g, params, i, h, 1, 0, out=None)
        _residual(g, params, i, h, partial, out=_hidden_name(i + 1, layers))
    return g.build(inputs=[("x", [BATCH, hidden])], outputs=[("y", [BATCH, hidden])])


# ---------------------------------------------------------------- arguments and weights


def _check_sizes(shape: MlpShape) -> None:
    for what, value in (("hidden", shape.hidden), ("ffn", shape.ffn), ("layers", shape.layers)):
        if value < 1:
            raise ExportError(f"{what} must be >= 1, got {value}")


def _check_arguments(shape: MlpShape, rank_size: int, stage_size: int) -> int:
    """Refuse what cannot be cut; return the ranks per stage."""
    _check_sizes(shape)
    parts = check_layout(rank_size, stage_size)
    if shape.layers < stage_size:
        raise ExportError(
            f"{shape.layers} blocks cannot fill {stage_size} pipeline stages; "
            f"layers must be >= stage_size"
        )
    check_divides(
        shape.ffn, parts, f"fc1 columns and fc2 rows are split over the {shape.ffn} ffn units"
    )
    return parts


def random_weights(seed: int, shape: MlpShape) -> Weights:
    """Scaled normals from ``numpy.random.default_rng(seed)``, drawn in name order."""
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(dims, dtype=np.float32) * np.float32(WEIGHT_SCALE))
        for name, dims in shape.weight_shapes().items()
    }


def load_weights(path: Path, shape: MlpShape) -> Weights:
    """Read an ``.npz`` (no pickles) and check it has exactly the expected names and shapes."""
    expected = shape.weight_shapes()
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read weights {path}: {exc}") from exc
    problems = [f"missing {n}" for n in expected if n not in arrays]
    problems += [f"unexpected {n}" for n in sorted(arrays) if n not in expected]
    problems += [
        f"{n} has shape {list(arrays[n].shape)}, expected {list(dims)}"
        for n, dims in expected.items()
        if n in arrays and arrays[n].shape != dims
    ]
    problems += [
        f"{n} has dtype {arrays[n].dtype}, expected a float"
        for n in expected
        if n in arrays and arrays[n].dtype.kind != "f"
    ]
    if problems:
        raise ExportError(f"weights {path} do not fit this MLP: " + "; ".join(problems))
    return {n: arrays[n].astype(np.float32) for n in expected}


def stage_blocks(layers: int, stage_size: int) -> list[range]:
    """Blocks per stage, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(layers, stage_size)
    ranges, start = [], 0
    for stage in range(stage_size):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


# ---------------------------------------------------------------- stage programs


def _hidden_name(block: int, layers: int) -> str:
    """The hidden state entering ``block`` ("x" first, "y" after the last block)."""
    if block == 0:
        return "x"
    return "y" if block == layers else f"h{block}"


def _segment_file(k: int) -> str:
    return f"seg{k}.onnx"


def _stage_plan(blocks: range, layers: int, parts: int) -> StagePlan:
    """One segment per stage when unsliced; otherwise segment k ends block k's local part
    and the allreduce after it joins the ranks, and segment k+1 finishes block k."""
    inputs = (_hidden_name(blocks.start, layers),)
    outputs = (_hidden_name(blocks.stop, layers),)
    if parts == 1:
        return StagePlan(inputs=inputs, outputs=outputs, program=(RunOp(file=_segment_file(0)),))
    program: list[ProgramOp] = []
    for k, block in enumerate(blocks):
        program.append(RunOp(file=_segment_file(k)))
        program.append(AllReduceOp(input=f"block{block}.partial", output=f"block{block}.sum"))
    program.append(RunOp(file=_segment_file(len(blocks))))
    return StagePlan(inputs=inputs, outputs=outputs, program=tuple(program))


# ---------------------------------------------------------------- segments


def _stage_segments(
    params: Weights, shape: MlpShape, blocks: range, parts: int, index: int, rank: int
) -> dict[str, onnx.ModelProto]:
    if parts == 1:
        return {_segment_file(0): _whole_stage(params, shape, blocks, rank)}
    return {
        _segment_file(k): _sliced_segment(params, shape, blocks, k, parts, index, rank)
        for k in range(len(blocks) + 1)
    }


def _whole_stage(params: Weights, shape: MlpShape, blocks: range, rank: int) -> onnx.ModelProto:
    g = GraphBuilder(f"mlp_rank{rank}_seg0")
    for i in blocks:
        h = _hidden_name(i, shape.layers)
        partial = _block_partial(g, params, i, h, 1, 0, out=None)
        _residual(g, params, i, h, partial, out=_hidden_name(i + 1, shape.layers))
    first, last = _hidden_name(blocks.start, shape.layers), _hidden_name(blocks.stop, shape.layers)
    return g.build(inputs=[(first, [BATCH, shape.hidden])], outputs=[(last, [BATCH, shape.hidden])])


def _sliced_segment(
    params: Weights, shape: MlpShape, blocks: range, k: int, parts: int, index: int, rank: int
) -> onnx.ModelProto:
    """Segment k of a sliced stage: finish block k-1 (if k > 0), start block k (if any)."""
    g = GraphBuilder(f"mlp_rank{rank}_seg{k}")
    state: list[int | str] = [BATCH, shape.hidden]
    inputs: list[tuple[str, list[int | str]]] = []
    outputs: list[tuple[str, list[int | str]]] = []
    block = blocks.start + k
    h = _hidden_name(block, shape.layers)
    if k == 0:
        inputs.append((h, state))
    else:
        previous = _hidden_name(block - 1, shape.layers)
        inputs += [(previous, state), (f"block{block - 1}.sum", state)]
        _residual(g, params, block - 1, previous, f"block{block - 1}.sum", out=h)
        outputs.append((h, state))  # the next segment adds it back as the residual
    if block < blocks.stop:
        partial = _block_partial(g, params, block, h, parts, index, out=f"block{block}.partial")
        outputs.append((partial, state))
    return g.build(inputs=inputs, outputs=outputs)


def _block_partial(
    g: GraphBuilder,
    params: Weights,
    block: int,
    h: str,
    parts: int,
    index: int,
    out: str | None,
) -> str:
    """This rank's share of gelu(h @ W1 + b1) @ W2 (the whole product when parts == 1)."""
    units = split_range(params[f"block{block}.fc1.bias"].shape[0], parts, index)
    w1 = g.constant(f"block{block}.fc1.weight", params[f"block{block}.fc1.weight"][:, units])
    b1 = g.constant(f"block{block}.fc1.bias", params[f"block{block}.fc1.bias"][units])
    w2 = g.constant(f"block{block}.fc2.weight", params[f"block{block}.fc2.weight"][units, :])
    pre = g.op("Add", g.op("MatMul", h, w1), b1)
    return g.op("MatMul", _gelu(g, pre), w2, out=out)


def _residual(g: GraphBuilder, params: Weights, block: int, h: str, product: str, out: str) -> str:
    """h + (product + b2): the fc2 bias once, after the ranks' partials are summed."""
    b2 = g.constant(f"block{block}.fc2.bias", params[f"block{block}.fc2.bias"])
    return g.op("Add", h, g.op("Add", product, b2), out=out)


def _gelu(g: GraphBuilder, x: str) -> str:
    """Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))), from ops every onnxruntime has."""
    scaled = g.op("Div", x, _scalar(g, "sqrt2", float(np.sqrt(2.0))))
    plus_one = g.op("Add", g.op("Erf", scaled), _scalar(g, "one", 1.0))
    return g.op("Mul", g.op("Mul", x, plus_one), _scalar(g, "half", 0.5))


def _scalar(g: GraphBuilder, hint: str, value: float) -> str:
    return g.constant(hint, np.array(value, dtype=np.float32))


__all__ = [
    "MlpShape",
    "export_mlp",
    "load_weights",
    "random_weights",
    "reference_model",
    "stage_blocks",
]
