"""The transformer's shape, its weights and how its blocks spread over ranks and stages.

Weights (``--weights file.npz``, float arrays; all names required, no others allowed)::

    wte                       [vocab, hidden]       token embedding
    wpe                       [max_seq, hidden]     position embedding
    block{i}.ln1.gamma/.beta  [hidden]
    block{i}.attn.qkv.weight  [hidden, 3*hidden]    columns [Q | K | V], heads in order
    block{i}.attn.qkv.bias    [3*hidden]
    block{i}.attn.proj.weight [hidden, hidden]
    block{i}.attn.proj.bias   [hidden]
    block{i}.ln2.gamma/.beta  [hidden]
    block{i}.mlp.fc.weight    [hidden, 4*hidden]
    block{i}.mlp.fc.bias      [4*hidden]
    block{i}.mlp.proj.weight  [4*hidden, hidden]
    block{i}.mlp.proj.bias    [hidden]
    lnf.gamma/.beta           [hidden]
    lm_head.weight            [hidden, vocab]

Without a file, weights are ``numpy.random.default_rng(seed)`` normals x 0.02 drawn in
the order above (LayerNorm gamma 1, beta 0). Same arguments -> same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardserve.errors import ExportError

Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_seq: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def weight_shapes(shape: TransformerShape) -> dict[str, tuple[int, ...]]:
    """Every weight name and its shape, in the order random weights are drawn."""
    h, v = shape.hidden, shape.vocab
    shapes: dict[str, tuple[int, ...]] = {"wte": (v, h), "wpe": (shape.max_seq, h)}
    for i in range(shape.layers):
        b = f"block{i}"
        shapes.update(
            {
                f"{b}.ln1.gamma": (h,),
                f"{b}.ln1.beta": (h,),
                f"{b}.attn.qkv.weight": (h, 3 * h),
                f"{b}.attn.qkv.bias": (3 * h,),
                f"{b}.attn.proj.weight": (h, h),
                f"{b}.attn.proj.bias": (h,),
                f"{b}.ln2.gamma": (h,),
                f"{b}.ln2.beta": (h,),
                f"{b}.mlp.fc.weight": (h, 4 * h),
                f"{b}.mlp.fc.bias": (4 * h,),
                f"{b}.mlp.proj.weight": (4 * h, h),
                f"{b}.mlp.proj.bias": (h,),
            }
        )
    shapes.update({"lnf.gamma": (h,), "lnf.beta": (h,), "lm_head.weight": (h, v)})
    return shapes


def random_weights(shape: TransformerShape, seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for name, dims in weight_shapes(shape).items():
        if name.endswith(".gamma"):
            weights[name] = np.ones(dims, np.float32)
        elif name.endswith(".beta"):
            weights[name] = np.zeros(dims, np.float32)
        else:
            weights[name] = (rng.standard_normal(dims) * 0.02).astype(np.float32)
    return weights


def load_weights(path: Path, shape: TransformerShape) -> Weights:
    """Read an .npz; refuse missing, unknown, wrongly shaped or non-float arrays by name."""
    expected = weight_shapes(shape)
    try:
        with np.load(path, allow_pickle=False) as archive:
            found = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read weights file {path}: {exc}") from exc
    problems = [f"missing {n} {list(s)}" for n, s in expected.items() if n not in found]
    problems += [f"unknown {n}" for n in found if n not in expected]
    problems += [
        f"{n} has shape {list(a.shape)}, expected {list(expected[n])}"
        for n, a in found.items()
        if n in expected and a.shape != expected[n]
    ]
    problems += [
        f"{n} has dtype {a.dtype}, expected a float type"
        for n, a in found.items()
        if n in expected and a.dtype.kind != "f"
    ]
    if problems:
        raise ExportError(f"weights file {path} does not fit the model: " + "; ".join(problems))
    return {n: np.ascontiguousarray(found[n], dtype=np.float32) for n in expected}


@dataclass(frozen=True)
class Layout:
    """How the model is spread: ranks per stage and the blocks of each stage."""

    ranks: int  # ranks per stage
    blocks: tuple[range, ...]

    @property
    def stages(self) -> int:
        return len(self.blocks)


def plan_layout(shape: TransformerShape, rank_size: int, stage_size: int) -> Layout:
    """Refuse splits that cannot work, saying why; spread the blocks over the stages."""
    if rank_size < 1 or stage_size < 1:
        raise ExportError(f"rank_size and stage_size must be >= 1, got {rank_size}, {stage_size}")
    if rank_size % stage_size != 0:
        raise ExportError(f"rank_size {rank_size} is not a multiple of stage_size {stage_size}")
    for what, value in (
        ("layers", shape.layers),
        ("hidden", shape.hidden),
        ("heads", shape.heads),
        ("vocab", shape.vocab),
        ("max_seq", shape.max_seq),
    ):
        if value < 1:
            raise ExportError(f"{what} must be >= 1, got {value}")
    if shape.hidden % shape.heads != 0:
        raise ExportError(f"hidden {shape.hidden} is not divisible by heads {shape.heads}")
    ranks = rank_size // stage_size
    if shape.heads % ranks != 0:
        raise ExportError(f"heads {shape.heads} are not divisible by {ranks} ranks per stage")
    if shape.hidden % ranks != 0:
        raise ExportError(f"hidden {shape.hidden} is not divisible by {ranks} ranks per stage")
    if shape.layers < stage_size:
        raise ExportError(f"{shape.layers} layers cannot fill {stage_size} pipeline stages")
    base, extra = divmod(shape.layers, stage_size)
    bounds = [0]
    for s in range(stage_size):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return Layout(ranks, tuple(range(bounds[s], bounds[s + 1]) for s in range(stage_size)))
