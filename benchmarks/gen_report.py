"""The generation benchmark's targets (issue 30) as ratios of one run, and its table.

Medians, not means, for inter-token latencies: on a 2-core machine shared with other work a
few preempted steps move the mean far more than the typical step.

Memory: an agent's RSS against its slice's weights plus its KV budget, after a fixed
overhead stated as the small model's TP 1 agent's RSS less its own slice (what an agent
costs before its model: Python, onnxruntime, the broker client, a nearly empty KV cache).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.gen_bar_report import REAL, bar_ratios, bar_table, real_ratios
from benchmarks.ratios import Ratio, fmt


def _metric(results: dict[str, Any], key: str, metric: str, stat: str = "median") -> float | None:
    entry = results.get(key)
    if not isinstance(entry, dict) or not entry.get("completed"):
        return None
    value = entry.get(metric)
    value = value.get(stat) if isinstance(value, dict) else value
    return float(value) if isinstance(value, int | float) and not math.isnan(value) else None


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def generation_ratios(results: dict[str, Any]) -> list[Ratio]:
    labels = results.get("gen.targets")
    if not isinstance(labels, dict):
        return [*bar_ratios(results), *real_ratios(results)]
    return [
        *bar_ratios(results),
        *real_ratios(results),
        *_overhead(results, labels),
        *_batching(results, labels),
        _tensor_parallel(results, labels),
        *_memory(results),
        *_decode_runs(results, labels),
    ]


def _overhead(r: dict[str, Any], labels: dict[str, str]) -> list[Ratio]:
    small, large = labels["small.c1"], labels["large.c1"]
    small_mesh = _metric(r, f"gen.small.mesh-tp1.{small}", "itl_ms")
    small_floor = _metric(r, f"gen.small.floor.{small}", "itl_ms")
    large_mesh = _metric(r, f"gen.large.mesh-tp1.{large}", "itl_ms")
    large_floor = _metric(r, f"gen.large.floor.{large}", "itl_ms")
    extra = None if small_mesh is None or small_floor is None else small_mesh - small_floor
    return [
        Ratio(
            "gen small: mesh TP1 ITL - floor ITL (ms, 1 seq)",
            extra,
            "<= 1.5",
            f"median ITL {small}: mesh {fmt(small_mesh)} ms, floor {fmt(small_floor)} ms",
        ),
        Ratio(
            "gen large: mesh TP1 ITL / floor ITL (1 seq)",
            _div(large_mesh, large_floor),
            "<= 1.1",
            f"median ITL {large}: mesh {fmt(large_mesh)} ms, floor {fmt(large_floor)} ms",
        ),
    ]


def _decode_runs(r: dict[str, Any], labels: dict[str, str]) -> list[Ratio]:
    """Decode runs (the default) against the scheduler on every token's path
    (``mesh-tp1-step1``): the comparison issue 29 asks for, decided by these figures."""
    small, large = labels["small.c1"], labels["large.c32"]
    runs = _metric(r, f"gen.small.mesh-tp1.{small}", "itl_ms")
    each = _metric(r, f"gen.small.mesh-tp1-step1.{small}", "itl_ms")
    runs32 = _metric(r, f"gen.large.mesh-tp1.{large}", "output_throughput")
    each32 = _metric(r, f"gen.large.mesh-tp1-step1.{large}", "output_throughput")
    return [
        Ratio(
            "gen small: ITL decode runs / scheduler every step (1 seq)",
            _div(runs, each),
            "-",
            f"median ITL {small}: runs {fmt(runs)} ms, every step {fmt(each)} ms",
        ),
        Ratio(
            "gen large: tok/s decode runs / scheduler every step (c32)",
            _div(runs32, each32),
            "-",
            f"output tok/s {large}: runs {fmt(runs32)}, every step {fmt(each32)}",
        ),
    ]


def _batching(r: dict[str, Any], labels: dict[str, str]) -> list[Ratio]:
    one, many = labels["large.c1"], labels["large.c32"]
    c32 = _metric(r, f"gen.large.mesh-tp1.{many}", "output_throughput")
    c1 = _metric(r, f"gen.large.mesh-tp1.{one}", "output_throughput")
    peer = _metric(r, f"gen.large.peer.{one}", "output_throughput")
    floor1 = _metric(r, f"gen.large.floor.{one}", "output_throughput")
    floor32 = _metric(r, f"gen.large.floor-b32.{one.replace('.c1', '.c32')}", "output_throughput")
    detail = f"output tok/s: mesh c32 {fmt(c32)}, mesh c1 {fmt(c1)}, peer {fmt(peer)}"
    return [
        Ratio("gen large: mesh c32 / mesh c1 output tok/s", _div(c32, c1), ">= 8", detail),
        Ratio("gen large: mesh c32 / peer output tok/s", _div(c32, peer), ">= 10", detail),
        Ratio(
            "gen large: floor static batch 32 / floor 1 seq tok/s",
            _div(floor32, floor1),
            "-",
            f"the model alone: {fmt(floor32)} vs {fmt(floor1)} tok/s (batching ceiling)",
        ),
    ]


def _tensor_parallel(r: dict[str, Any], labels: dict[str, str]) -> Ratio:
    one = labels["large.c1"]
    tp1 = _metric(r, f"gen.large.mesh-tp1.{one}", "itl_ms")
    tp2 = _metric(r, f"gen.large.mesh-tp2.{one}", "itl_ms")
    return Ratio(
        "gen large: TP2 ITL / TP1 ITL (1 seq, 1 thread/rank)",
        _div(tp2, tp1),
        "<= 0.65",
        f"median ITL {one}: TP2 {fmt(tp2)} ms, TP1 {fmt(tp1)} ms",
    )


def _memory(r: dict[str, Any]) -> list[Ratio]:
    small = (r.get("gen.small.mesh-tp1.memory") or {}).get("r0")
    large = (r.get("gen.large.mesh-tp1.memory") or {}).get("r0")
    tp2 = r.get("gen.large.mesh-tp2.memory") or {}
    if not small or not large:
        return [Ratio("gen large: agent RSS vs slice + KV budget", None, "<= 1.2", "not measured")]
    overhead = small["rss_mb"] - small["slice_mb"]
    need = large["slice_mb"] + large["kv_budget_mb"]
    per_rank = [v["kv_bytes_per_token"] for v in tp2.values()]
    kv_share = _div(max(per_rank), large["kv_bytes_per_token"]) if per_rank else None
    return [
        Ratio(
            "gen large: (agent RSS - overhead) / (slice + KV budget)",
            _div(large["rss_mb"] - overhead, need),
            "<= 1.2",
            f"TP1 agent RSS {large['rss_mb']} MB, slice {large['slice_mb']} MB, KV budget "
            f"{large['kv_budget_mb']} MB, fixed overhead {overhead:.0f} MB (small agent RSS "
            "less its slice)",
        ),
        Ratio(
            "gen large: KV bytes/token per rank, TP2 / TP1",
            kv_share,
            "<= 0.5",
            f"per rank at TP2 {per_rank}, unsliced {large['kv_bytes_per_token']} (target 1/R)",
        ),
    ]


def generation_table(results: dict[str, Any]) -> list[str]:
    """One row per generation load: vLLM's figures (ms: mean / median / p99)."""
    head = (
        f"{'generation load':<44} {'TTFT ms':>22} {'TPOT ms':>22} {'ITL ms':>22} "
        f"{'E2EL ms':>24} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9} {'fail':>4}"
    )
    lines = [head]
    for key, entry in results.items():
        if key.startswith("gen.") and isinstance(entry, dict) and "itl_ms" in entry:
            cells = [_triple(entry[m]) for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")]
            lines.append(
                f"{key.removeprefix('gen.'):<44} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} "
                f"{cells[3]:>24} {entry['request_throughput']:>7.2f} "
                f"{entry['output_throughput']:>9.1f} {entry['total_token_throughput']:>9.1f} "
                f"{entry['failed']:>4}"
            )
    return lines if len(lines) > 1 else []


def _triple(stats: dict[str, float]) -> str:
    return "/".join(_short(stats[k]) for k in ("mean", "median", "p99"))


def _short(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def markdown_table(results: dict[str, Any]) -> list[str]:
    """The generation rows as a Markdown table (docs/performance.md's "Generation")."""
    lines = [
        "| load | TTFT ms mean / med / p99 | TPOT ms mean / med / p99 | ITL ms mean / med / p99 "
        "| E2EL ms mean / med / p99 | req/s | out tok/s | total tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in results.items():
        if key.startswith("gen.") and isinstance(entry, dict) and "itl_ms" in entry:
            cells = [
                _triple(entry[m]).replace("/", " / ")
                for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
            ]
            lines.append(
                f"| {key.removeprefix('gen.')} | {' | '.join(cells)} | "
                f"{entry['request_throughput']:.2f} | {entry['output_throughput']:.1f} | "
                f"{entry['total_token_throughput']:.1f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gen_report RESULTS.json``: the table and the targets, Markdown."""
    import json
    import sys
    from pathlib import Path

    [path] = argv if argv is not None else sys.argv[1:]
    results = json.loads(Path(path).read_text())["results"]
    print("\n".join(bar_table(results)))
    print("\n".join(bar_table(results, REAL)))
    print()
    print("\n".join(markdown_table(results)))
    print("\n| target | value | bound | verdict |\n|---|---|---|---|")
    for ratio in generation_ratios(results):
        verdict = {True: "met", False: "missed", None: ""}[ratio.passed]
        print(
            f"| {ratio.name} ({ratio.detail}) | {fmt(ratio.value)} | {ratio.target} | {verdict} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
