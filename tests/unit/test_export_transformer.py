"""The transformer exporter: sliced == unsliced, reference == numpy, refusals, determinism."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from shardserve.errors import ExportError
from shardserve.repo.repository import AllGatherOp, AllReduceOp, load_group
from shardserve.runtime.program import run_group_locally
from shardserve.servable import load_servable_config
from shardserve.tools.export.transformer import (
    TransformerShape,
    export_transformer,
    random_weights,
    reference_model,
)

SIZE: dict[str, Any] = {"layers": 4, "hidden": 32, "heads": 8, "vocab": 48, "max_seq": 16}


def _save_npz(path: Path, weights: dict[str, np.ndarray]) -> None:
    arrays: dict[str, Any] = dict(weights)
    np.savez(path, **arrays)


def _run_reference(ids: np.ndarray, **size: Any) -> np.ndarray:
    session = ort.InferenceSession(reference_model(**size).SerializeToString())
    return np.asarray(session.run(None, {"input_ids": ids})[0])


def _run_group(repo: Path, ids: np.ndarray, group_name: str = "transformer") -> list[np.ndarray]:
    group = load_group(repo, group_name, 1)
    outputs = asyncio.run(run_group_locally(repo, group, {"input_ids": ids}))
    return [o["logits"] for o in outputs]


def _ids(seq: int = 7, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(3).integers(0, SIZE["vocab"], (batch, seq)).astype(np.int64)


@pytest.mark.parametrize(
    ("rank_size", "stage_size"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (8, 2), (4, 4)]
)
def test_sliced_equals_unsliced(tmp_path: Path, rank_size: int, stage_size: int) -> None:
    lines: list[str] = []
    group = export_transformer(
        tmp_path, rank_size=rank_size, stage_size=stage_size, progress=lines.append, **SIZE
    )
    ids = _ids()
    want = _run_reference(ids, **SIZE)
    got = _run_group(tmp_path, ids)
    assert len(got) == rank_size // stage_size
    assert np.abs(got[0] - want).max() <= 1e-5
    assert all(np.array_equal(g, got[0]) for g in got)  # last-stage ranks agree bitwise
    assert sum(line.startswith("rank ") for line in lines) == rank_size
    assert group.with_batch_dim and group.rank_size == rank_size


def test_collectives_split_heads_and_mlp(tmp_path: Path) -> None:
    group = export_transformer(tmp_path, rank_size=4, stage_size=2, **SIZE)
    first, last = group.stages
    assert first.inputs == ("input_ids",) and first.outputs == ("hidden.2",)
    assert last.inputs == ("hidden.2",) and last.outputs == ("logits",)
    reduces = [op for op in first.program if isinstance(op, AllReduceOp)]
    assert len(reduces) == 4  # attention + MLP for each of the stage's 2 blocks
    assert isinstance(last.program[-1], AllGatherOp)  # vocab 48 splits over 2 ranks


def test_head_replicated_when_vocab_does_not_divide(tmp_path: Path) -> None:
    size: dict[str, Any] = {**SIZE, "vocab": 50}
    group = export_transformer(tmp_path, rank_size=4, stage_size=1, **size)
    assert not any(isinstance(op, AllGatherOp) for op in group.stages[0].program)
    ids = np.random.default_rng(5).integers(0, 50, (1, 5)).astype(np.int64)
    got = _run_group(tmp_path, ids)
    assert np.abs(got[0] - _run_reference(ids, **size)).max() <= 1e-5


def _numpy_forward(
    ids: np.ndarray, w: dict[str, np.ndarray], heads: int, layers: int
) -> np.ndarray:
    def norm(x: np.ndarray, p: str) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * w[f"{p}.gamma"] + w[f"{p}.beta"]

    erf = np.vectorize(math.erf)
    seq = ids.shape[1]
    h = w["wte"][ids] + w["wpe"][:seq]
    hidden = h.shape[-1]
    d = hidden // heads
    future = np.triu(np.ones((seq, seq), bool), 1)
    for i in range(layers):
        b = f"block{i}"
        qkv = norm(h, f"{b}.ln1") @ w[f"{b}.attn.qkv.weight"] + w[f"{b}.attn.qkv.bias"]
        q, k, v = (qkv[..., j * hidden : (j + 1) * hidden] for j in range(3))
        q, k, v = (t.reshape(*t.shape[:2], heads, d).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = np.where(future, -np.inf, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d))
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        mixed = (p @ v).transpose(0, 2, 1, 3).reshape(h.shape)
        h = h + mixed @ w[f"{b}.attn.proj.weight"] + w[f"{b}.attn.proj.bias"]
        a = norm(h, f"{b}.ln2") @ w[f"{b}.mlp.fc.weight"] + w[f"{b}.mlp.fc.bias"]
        gelu = 0.5 * a * (1 + erf(a / math.sqrt(2)))
        h = h + gelu @ w[f"{b}.mlp.proj.weight"] + w[f"{b}.mlp.proj.bias"]
    return np.asarray(norm(h, "lnf") @ w["lm_head.weight"])


def test_reference_model_matches_numpy() -> None:
    shape = TransformerShape(
        SIZE["layers"], SIZE["hidden"], SIZE["heads"], SIZE["vocab"], SIZE["max_seq"]
    )
    weights = {k: v.astype(np.float64) for k, v in random_weights(shape, 0).items()}
    ids = _ids(seq=9)
    want = _numpy_forward(ids, weights, SIZE["heads"], SIZE["layers"])
    assert np.abs(_run_reference(ids, **SIZE) - want).max() <= 1e-5


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        export_transformer(tmp_path / folder, rank_size=2, stage_size=2, **SIZE)
    files_a = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    files_b = sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file()
    )
    assert files_a == files_b and files_a
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_weights_file_round_trip(tmp_path: Path) -> None:
    shape = TransformerShape(2, 32, 4, 50, 16)
    weights = random_weights(shape, 7)
    path = tmp_path / "w.npz"
    _save_npz(path, weights)
    size: dict[str, Any] = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 50, "max_seq": 16}
    export_transformer(tmp_path / "repo", rank_size=2, weights=path, **size)
    ids = np.random.default_rng(1).integers(0, 50, (1, 6)).astype(np.int64)
    from_file = _run_group(tmp_path / "repo", ids)[0]
    assert np.abs(from_file - _run_reference(ids, seed=7, **size)).max() <= 1e-5
    assert np.abs(from_file - _run_reference(ids, seed=0, **size)).max() > 1e-4


def test_weights_file_problems_are_named(tmp_path: Path) -> None:
    shape = TransformerShape(2, 32, 4, 50, 16)
    weights = random_weights(shape, 0)
    weights.pop("block1.ln2.beta")
    weights["block0.mlp.fc.bias"] = np.zeros(3, np.float32)
    weights["surprise"] = np.zeros(1, np.float32)
    path = tmp_path / "w.npz"
    _save_npz(path, weights)
    with pytest.raises(ExportError) as info:
        export_transformer(
            tmp_path / "repo", layers=2, hidden=32, heads=4, vocab=50, max_seq=16, weights=path
        )
    message = str(info.value)
    assert "missing block1.ln2.beta" in message
    assert "block0.mlp.fc.bias has shape [3], expected [128]" in message
    assert "unknown surprise" in message


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"heads": 4, "rank_size": 8}, "heads 4 are not divisible by 8 ranks per stage"),
        ({"hidden": 30, "heads": 4}, "hidden 30 is not divisible by heads 4"),
        ({"layers": 2, "rank_size": 4, "stage_size": 4}, "2 layers cannot fill 4 pipeline stages"),
        ({"rank_size": 3, "stage_size": 2}, "rank_size 3 is not a multiple of stage_size 2"),
    ],
)
def test_refusals(tmp_path: Path, changes: dict[str, int], fragment: str) -> None:
    args: dict[str, Any] = {**SIZE, **changes}
    with pytest.raises(ExportError, match=fragment):
        export_transformer(tmp_path, **args)
    assert not (tmp_path / "transformer" / "1").exists()


def test_servable_config_declares_the_layout(tmp_path: Path) -> None:
    export_transformer(tmp_path, rank_size=4, stage_size=2, **SIZE)
    definition = load_servable_config(tmp_path / "transformer" / "servable_config.py")
    assert definition.model is not None
    assert (definition.model.rank_size, definition.model.stage_size) == (4, 2)
    assert definition.model.with_batch_dim
    method = definition.methods["predict"]
    assert method.input_names == ("input_ids",) and method.output_names == ("logits",)


def test_input_ids_carry_vocab_and_sequence_bounds(tmp_path: Path) -> None:
    """group.json bounds the token ids and the sequence length the exported model can take."""
    export_transformer(tmp_path, rank_size=2, stage_size=1, **SIZE)
    (spec,) = load_group(tmp_path, "transformer", 1).inputs
    assert (spec.min_value, spec.max_value) == (0, SIZE["vocab"] - 1)
    assert spec.max_shape == (-1, SIZE["max_seq"])
    (logits,) = load_group(tmp_path, "transformer", 1).outputs
    assert logits.min_value is None and logits.max_shape is None
