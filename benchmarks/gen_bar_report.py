"""The bar's targets (issue 35) as ratios of one run, and its table: every system on the
same checkpoint with 2 threads (``gen_bar``), beside the bytes / bandwidth floor.

- c1 ITL: shardserve fp32 <= llama.cpp F32, int8 <= Q8_0, int4 <= Q4_0 (medians);
- c32 output tok/s: shardserve >= 1.5x llama.cpp at each precision;
- c1 TTFT (128-token prompt): shardserve <= llama.cpp at each precision;
- agent RSS <= 1.2 x (slice + KV budget) + fixed, the fixed part being the small model's
  TP 1 agent's RSS less its slice (``gen_report._memory``'s overhead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.gen_triad import bytes_floor_ms
from benchmarks.ratios import Ratio, fmt

PAIRS = (("fp32", "F32"), ("int8", "Q8_0"), ("int4", "Q4_0"))
SYSTEMS = {  # result key -> what the table calls it
    "llama-F32": "llama.cpp llama-server F32 GGUF",
    "llama-Q8_0": "llama.cpp llama-server Q8_0 GGUF",
    "llama-Q4_0": "llama.cpp llama-server Q4_0 GGUF",
    "ortgenai": "onnxruntime-genai, in process (c32: static batch)",
    "mesh-tp1-fp32": "shardserve TP 1",
    "mesh-tp1-int8": "shardserve TP 1 int8",
    "mesh-tp1-int4": "shardserve TP 1 int4",
    "mesh-tp2-fp32": "shardserve TP 2 (1 thread per rank)",
    "mesh-tp1-fp32-1t": "shardserve TP 1, 1 thread (reference)",
}


@dataclass(frozen=True)
class Bar:
    """One bar's results: their key prefix, its (ours, llama.cpp's) precision pairs and
    mesh name, and the table's systems."""

    prefix: str
    pairs: tuple[tuple[str, str], ...]
    systems: dict[str, str]
    title: str = "bar"


BAR = Bar("gen.bar", PAIRS, SYSTEMS)
# gen_real: SmolLM2-135M-Instruct's Q8_0 and Q4_0 files, served as they are by both.
REAL = Bar(
    "gen.real",
    (("Q8_0", "Q8_0"), ("Q4_0", "Q4_0")),
    {
        "llama-Q8_0": "llama.cpp llama-server, SmolLM2 Q8_0 GGUF",
        "llama-Q4_0": "llama.cpp llama-server, SmolLM2 Q4_0 GGUF",
        "mesh-tp1-Q8_0": "shardserve TP 1, the same file's blocks",
        "mesh-tp1-Q4_0": "shardserve TP 1, the same file's blocks",
    },
    "real model",
)


def _figure(r: dict[str, Any], system: str, load: str, metric: str, bar: Bar = BAR) -> float | None:
    entry = r.get(f"{bar.prefix}.{system}.{load}")
    if not isinstance(entry, dict) or not entry.get("completed") or entry.get("failed"):
        return None
    value = entry.get(metric)
    value = value.get("median") if isinstance(value, dict) else value
    return float(value) if isinstance(value, int | float) and not math.isnan(value) else None


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _why_missing(r: dict[str, Any], system: str) -> str:
    info = r.get(f"gen.bar.{system}.info") or {}
    return f" ({info['skipped']})" if info.get("skipped") else ""


def bar_ratios(r: dict[str, Any]) -> list[Ratio]:
    ratios = _pair_ratios(r, BAR)
    return [*ratios, _memory(r)] if ratios else []


def real_ratios(r: dict[str, Any]) -> list[Ratio]:
    return _pair_ratios(r, REAL)


def _pair_ratios(r: dict[str, Any], bar: Bar) -> list[Ratio]:
    labels = r.get(f"{bar.prefix}.targets")
    if not isinstance(labels, dict):
        return []
    c1, c32 = labels["c1"], labels["c32"]
    ratios: list[Ratio] = []
    for ours, theirs in bar.pairs:
        mesh, llama = f"mesh-tp1-{ours}", f"llama-{theirs}"
        why = _why_missing(r, mesh)
        for metric, name, bound, load in (
            ("itl_ms", "c1 ITL", "<= 1.0", c1),
            ("output_throughput", "c32 out tok/s", ">= 1.5", c32),
            ("ttft_ms", "c1 TTFT", "<= 1.0", c1),
        ):
            a, b = _figure(r, mesh, load, metric, bar), _figure(r, llama, load, metric, bar)
            ratios.append(
                Ratio(
                    f"{bar.title}: {name} shardserve {ours} / llama.cpp {theirs}",
                    _div(a, b),
                    bound,
                    f"{load}: shardserve {fmt(a)}{why}, llama.cpp {fmt(b)}",
                )
            )
    return ratios


def _memory(r: dict[str, Any]) -> Ratio:
    info = r.get("gen.bar.mesh-tp1-fp32.info") or {}
    small = (r.get("gen.small.mesh-tp1.memory") or {}).get("r0")
    agent = (info.get("memory") or {}).get("r0")
    if not small or not agent:
        return Ratio(
            "bar: (agent RSS - fixed) / (slice + KV budget)", None, "<= 1.2", "not measured"
        )
    fixed = small["rss_mb"] - small["slice_mb"]
    need = agent["slice_mb"] + agent["kv_budget_mb"]
    return Ratio(
        "bar: (agent RSS - fixed) / (slice + KV budget)",
        _div(agent["rss_mb"] - fixed, need),
        "<= 1.2",
        f"TP1 agent RSS {agent['rss_mb']} MB, slice {agent['slice_mb']} MB, KV budget "
        f"{agent['kv_budget_mb']} MB, fixed {fixed:.0f} MB (small model's agent less its slice)",
    )


def bytes_floor(r: dict[str, Any], system: str, bar: Bar = BAR) -> float | None:
    """ms a token takes to read this system's weights at the run's triad bandwidth."""
    info = r.get(f"{bar.prefix}.{system}.info") or {}
    bandwidth = (r.get(f"{bar.prefix}.bandwidth") or {}).get("gb_per_s")
    weights = info.get("weight_bytes_per_token")
    return bytes_floor_ms(weights, bandwidth) if weights and bandwidth else None


def bar_table(r: dict[str, Any], bar: Bar = BAR) -> list[str]:
    """The Markdown table: one row per system (medians; ms; RSS of the biggest process)."""
    labels = r.get(f"{bar.prefix}.targets")
    if not isinstance(labels, dict):
        return []
    c1, c32 = labels["c1"], labels["c32"]
    lines = [
        "| system | precision | threads | c1 TTFT ms | c1 ITL ms | weights MB/token "
        "| bytes / bandwidth ms | c32 out tok/s | RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, name in bar.systems.items():
        info = r.get(f"{bar.prefix}.{system}.info")
        if not isinstance(info, dict):
            continue
        if info.get("skipped"):
            lines.append(
                f"| {name} | {info['precision']} | {info['threads']} | {info['skipped']} |||||"
            )
            continue
        weights = info.get("weight_bytes_per_token")
        cells = [
            fmt(_figure(r, system, c1, "ttft_ms", bar)),
            fmt(_figure(r, system, c1, "itl_ms", bar)),
            fmt(weights / 1e6 if weights else None),
            fmt(bytes_floor(r, system, bar)),
            fmt(_figure(r, system, c32, "output_throughput", bar)),
            fmt(info.get("rss_mb"), 4),
        ]
        lines.append(f"| {name} | {info['precision']} | {info['threads']} | {' | '.join(cells)} |")
    return lines
