"""``python -m benchmarks --only quality``: what ``--quantize`` costs in quality.

A pre-trained checkpoint (SmolLM2-135M-Instruct, made once by
``benchmarks/make_quality_checkpoint.py``; the folder from ``SHARDSERVE_QUALITY_CHECKPOINT``
or ``~/.cache/shardserve-quality/smollm2-135m``) is exported at fp32 and at each
quantization, every export run in this process (real onnxruntime, one rank) over the
committed text ``benchmarks/data/quality_sample.txt`` in one prefill. Per precision:
perplexity and its ratio to fp32's, and top-1 agreement (the share of positions whose
argmax, the greedy next token given the true prefix, equals fp32's). Targets: int8
perplexity within 1 % of fp32, int4 within 10 %.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "benchmarks" / "data" / "quality_sample.txt"
CHECKPOINT_ENV = "SHARDSERVE_QUALITY_CHECKPOINT"
DEFAULT_CHECKPOINT = Path.home() / ".cache" / "shardserve-quality" / "smollm2-135m"
# (label, --quantize, --block-size, --accuracy-level); fp32 first: the others' reference.
VARIANTS: tuple[tuple[str, str | None, int, int], ...] = (
    ("fp32", None, 32, 4),
    ("int8", "int8", 32, 4),
    ("int8-exact", "int8", 32, 0),
    ("int4", "int4", 32, 4),
    ("int4-exact", "int4", 32, 0),
    ("int4-mixed", "int4-mixed", 32, 4),
)
TARGETS = {"int8": 1.01, "int4": 1.10, "int4-mixed": 1.10}


@dataclass(frozen=True)
class Quality:
    perplexity: float
    argmax: np.ndarray  # [T-1] greedy next token at each position
    slice_bytes: int


def checkpoint_folder() -> Path:
    folder = Path(os.environ.get(CHECKPOINT_ENV) or DEFAULT_CHECKPOINT)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"no checkpoint at {folder}: make it with benchmarks/make_quality_checkpoint.py "
            f"(or set {CHECKPOINT_ENV})"
        )
    return folder


def sample_ids(folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return list(tokenizer.encode(SAMPLE.read_text()).ids)


def export(
    folder: Path, repo: Path, label: str, precision: str | None, block: int, level: int
) -> Path:
    from shardserve.tools.export.hf import export_hf
    from shardserve.tools.quantize import QuantizeSpec

    spec = None if precision is None else QuantizeSpec(precision, block, level)
    export_hf(folder, repo, name=label, quantize=spec)
    return repo / label / "1"


def run_prefill(repo: Path, label: str, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of ``ids`` in one packed prefill of the one-rank export."""
    from shardserve.repo.repository import load_group
    from shardserve.runtime.attention import StepAttention, StepLayout
    from shardserve.runtime.kv_cache import KVCache
    from shardserve.runtime.kv_shape import cache_shape
    from shardserve.runtime.program import run_group_locally

    group = load_group(repo, label, 1)
    cache = KVCache(cache_shape(group, 0), 1 << 30)
    cache.reserve(1, len(ids))
    inputs = {
        "input_ids": np.asarray(ids, np.int64),
        "positions": np.arange(len(ids), dtype=np.int64),
        "logit_rows": np.arange(len(ids), dtype=np.int64),
    }
    attention = [StepAttention(cache, StepLayout([(1, 0, len(ids))]))]
    results = asyncio.run(run_group_locally(repo, group, inputs, attention=attention))
    return np.asarray(results[0]["logits"])


def measure(logits: np.ndarray, ids: list[int], slice_bytes: int) -> Quality:
    """Perplexity of ``ids[1:]`` under ``logits [T, V]`` (row t predicts token t+1), and the
    greedy token of each row."""
    shifted = logits[:-1].astype(np.float64)
    top = shifted.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(shifted - top).sum(axis=-1)) + top[:, 0]
    nll = log_norm - shifted[np.arange(len(ids) - 1), ids[1:]]
    return Quality(float(np.exp(nll.mean())), shifted.argmax(axis=-1), slice_bytes)


def rank_bytes(version: Path) -> int:
    return sum(p.stat().st_size for p in (version / "rank_0").iterdir())


def quality(run: Any) -> None:
    folder = checkpoint_folder()
    ids = sample_ids(folder)
    repo = run.work / "quality"
    base: Quality | None = None
    for label, precision, block, level in VARIANTS:
        started = time.monotonic()
        version = export(folder, repo, label, precision, block, level)
        measured = measure(run_prefill(repo, label, ids), ids, rank_bytes(version))
        base = base or measured
        ratio = measured.perplexity / base.perplexity
        agreement = float(np.mean(measured.argmax == base.argmax))
        run.results[f"quality.{label}"] = {
            "checkpoint": folder.name,
            "tokens": len(ids),
            "block_size": block,
            "accuracy_level": level,
            "perplexity": round(measured.perplexity, 4),
            "perplexity_ratio": round(ratio, 4),
            "top1_agreement": round(agreement, 4),
            "slice_bytes": measured.slice_bytes,
        }
        target = TARGETS.get(precision or "")
        verdict = (
            ""
            if target is None
            else f" (target <= {target}: {'met' if ratio <= target else 'MISSED'})"
        )
        print(
            f"  quality {label}: ppl {measured.perplexity:.3f}, ratio {ratio:.4f}{verdict}, "
            f"top-1 agreement {agreement:.3f}, slice {measured.slice_bytes / 2**20:.1f} MiB "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
