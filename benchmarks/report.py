"""Ratios against their targets, the printed table, and the JSON results file.

Every ratio divides two figures measured in the same run, so machine speed cancels out.

Per-hop cost. A mesh request at rank 1 crosses the broker 4 times: gateway -> scheduler
(InferRequest), scheduler -> agent (StageWork), agent -> scheduler (StageResult),
scheduler -> gateway (InferReply). The floor that reads JSON as the gateway does
(``floor-numeric``; the orjson ``floor`` when that one did not run) does the same HTTP +
JSON + compute work with no broker, so ``mesh cost per hop = (mesh rank-1 p50 - floor
p50) / 4`` at 1 client (JSON bodies): it includes each hop's encode/decode, publish,
delivery and the services' own work around it. The raw broker round trip is 2 hops
with the same payloads (48 KiB request, 8 KiB reply) and no work, so ``raw one-hop = raw
round-trip p50 / 2``.
"""

from __future__ import annotations

import json
import math
import platform
import re
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.gen_bar_report import REAL, bar_table
from benchmarks.gen_report import generation_ratios, generation_table
from benchmarks.ratios import Ratio, fmt

MESH_HOPS_RANK1 = 4
RAW_ROUND_TRIP_HOPS = 2


def _get(results: dict[str, Any], key: str, field: str) -> float | None:
    entry = results.get(key)
    if not isinstance(entry, dict) or entry.get("requests", 1) == 0:
        return None
    value = entry.get(field)
    return float(value) if isinstance(value, int | float) else None


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def per_hop_ms(results: dict[str, Any]) -> tuple[float | None, float | None]:
    """(mesh cost per hop, raw one-hop) in ms, as defined in the module docstring."""
    floor = "floor-numeric" if "floor-numeric.json.c1" in results else "floor"
    extra = _sub(
        _get(results, "mesh1.json.c1", "p50_ms"), _get(results, f"{floor}.json.c1", "p50_ms")
    )
    mesh = None if extra is None else extra / MESH_HOPS_RANK1
    raw_rt = _get(results, "broker.c1", "p50_ms")
    raw = None if raw_rt is None else raw_rt / RAW_ROUND_TRIP_HOPS
    return mesh, raw


def floor_ratios(results: dict[str, Any], floor: str = "floor") -> list[Ratio]:
    """The issue's three ratios against one floor: ``floor`` (JSON by orjson),
    ``floor-numeric`` (JSON read as the gateway reads it) or ``floor-stdlib`` (Python's
    json module, what a plain server does)."""
    r = results
    label = {"floor": "floor", "floor-numeric": "numeric floor"}.get(floor, "stdlib floor")
    return [
        Ratio(
            f"mesh rank1 JSON c32 / {label} JSON c32 (req/s)",
            _div(_get(r, "mesh1.json.c32", "rps"), _get(r, f"{floor}.json.c32", "rps")),
            ">= 0.8",
            "throughput the mesh keeps of a single-process server",
        ),
        Ratio(
            f"mesh rank1 c1 p50 - {label} c1 p50 (ms, JSON)",
            _sub(_get(r, "mesh1.json.c1", "p50_ms"), _get(r, f"{floor}.json.c1", "p50_ms")),
            "<= 1.5",
            "latency the broker path adds to one request",
        ),
        Ratio(
            f"mesh rank1 binary c32 / {label} JSON c32 (req/s)",
            _div(_get(r, "mesh1.binary.c32", "rps"), _get(r, f"{floor}.json.c32", "rps")),
            ">= 3",
            "binary tensors vs the JSON floor",
        ),
    ]


def compute_ratios(results: dict[str, Any]) -> list[Ratio]:
    r = results
    mesh_hop, raw_hop = per_hop_ms(r)
    others = [
        ratio
        for floor in ("floor-numeric", "floor-stdlib")
        if f"{floor}.json.c32" in r
        for ratio in floor_ratios(r, floor)
    ]
    return [
        *floor_ratios(r),
        *others,
        gateway_cost_ratio(r),
        Ratio(
            "mesh cost per broker hop / raw one-hop",
            _div(mesh_hop, raw_hop),
            "<= 1.3",
            f"per hop: mesh {fmt(mesh_hop)} ms, raw {fmt(raw_hop)} ms (4 hops at rank 1)",
        ),
        Ratio(
            "TP8 JSON c32 / mesh rank1 JSON c32 (req/s)",
            _div(_get(r, "tp8.json.c32", "rps"), _get(r, "mesh1.json.c32", "rps")),
            ">= 0.5",
            "cost of 8-way tensor parallelism (allgather over the broker)",
        ),
        Ratio(
            "MLP batched / unbatched c32 (req/s)",
            _div(_get(r, "mlp.batched.c32", "rps"), _get(r, "mlp.unbatched.c32", "rps")),
            ">= 6",
            "dynamic batching, one row per request, MLP 1024-4096-1024",
        ),
        Ratio(
            "two-block MLP batched / unbatched c32 (req/s)",
            _div(_get(r, "mlp2.batched.c32", "rps"), _get(r, "mlp2.unbatched.c32", "rps")),
            "-",
            "the same with twice the compute per row (1024-4096-1024-4096-1024)",
        ),
        _ceiling(
            r,
            "mlp.ceiling",
            "MLP compute alone, 32-row / 1-row runs (rows/s)",
            "the same for the model alone: onnxruntime in-process, 1 thread",
        ),
        Ratio(
            "MLP 2-stage pipelined / max-inflight 1 c8 (req/s)",
            _div(_get(r, "pipeline.pipelined.c8", "rps"), _get(r, "pipeline.serial.c8", "rps")),
            ">= 1.7",
            "pipeline parallelism across stages",
        ),
        _ceiling(
            r,
            "pipeline.ceiling",
            "2 stage slices at once / one after another (rows/s)",
            "the same for the model alone: onnxruntime in-process, a thread per stage",
        ),
        memory_ratio(r),
        Ratio(
            "gRPC / REST binary c32 on the demo (req/s)",
            _div(_get(r, "grpc-demo.grpc.c32", "rps"), _get(r, "grpc-demo.rest-binary.c32", "rps")),
            ">= 1.0",
            "ModelInfer with raw tensors vs the binary tensor extension, TP8 matmul",
        ),
        Ratio(
            "gRPC / REST binary c1 on the demo (p50 ms)",
            _div(
                _get(r, "grpc-demo.grpc.c1", "p50_ms"),
                _get(r, "grpc-demo.rest-binary.c1", "p50_ms"),
            ),
            "<= 1.0",
            "one client at a time: latency of a lone request",
        ),
        *_generation_ratios(r),
    ]


def _generation_ratios(results: dict[str, Any]) -> list[Ratio]:
    return generation_ratios(results)


def cpu_ms(results: dict[str, Any], key: str, prefix: str = "") -> float | None:
    """The CPU ms per request of one load point's measured processes whose names start
    with ``prefix``, summed (the load generator's own left out)."""
    entry = results.get(key)
    cpu = entry.get("cpu_ms_per_request") if isinstance(entry, dict) else None
    picked = [v for name, v in (cpu or {}).items() if name != "loadgen" and name.startswith(prefix)]
    return float(sum(picked)) if picked else None


def gateway_cost_ratio(results: dict[str, Any]) -> Ratio:
    """CPU per request of the gateway app with an in-process answer over a bare aiohttp
    handler (``benchmarks.gateway_alone``), binary c32, beside the mesh's gateways."""
    alone = cpu_ms(results, "gateway-alone.gateway.binary.c32")
    bare = cpu_ms(results, "gateway-alone.bare.binary.c32")
    in_mesh = cpu_ms(results, "mesh1.binary.c32", prefix="gateway")
    return Ratio(
        "gateway alone / bare aiohttp, CPU per request, binary c32",
        _div(alone, bare),
        "-",
        f"gateway alone {fmt(alone)} ms, bare handler {fmt(bare)} ms, "
        f"the mesh's gateways {fmt(in_mesh)} ms (rank 1)",
    )


def _ceiling(results: dict[str, Any], key: str, name: str, detail: str) -> Ratio:
    """A compute-only reference (``benchmarks.ceilings``), shown beside its target ratio."""
    facts = results.get(key)
    value = facts.get("ratio") if isinstance(facts, dict) else None
    return Ratio(name, float(value) if isinstance(value, int | float) else None, "-", detail)


def memory_ratio(results: dict[str, Any]) -> Ratio:
    """(RSS - fixed overhead) / slice bytes of the whole-MLP agent; overhead = tiny agent RSS."""
    facts = results.get("memory") or {}
    tiny, big = facts.get("matmul.r0"), facts.get("mlp.r0")
    if not tiny or not big or not big.get("slice_mb"):
        return Ratio("agent (RSS - overhead) / slice weights", None, "<= 1.2", "not measured")
    overhead = tiny["rss_mb"]
    value = (big["rss_mb"] - overhead) / big["slice_mb"]
    return Ratio(
        "agent (RSS - overhead) / slice weights",
        value,
        "<= 1.2",
        f"MLP agent RSS {big['rss_mb']} MB, slice {big['slice_mb']} MB, "
        f"fixed overhead {overhead} MB (RSS of the matmul agent)",
    )


def load_table(results: dict[str, Any]) -> list[str]:
    lines = [f"{'measurement':<30} {'req/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}"]
    for key, entry in results.items():
        if isinstance(entry, dict) and "rps" in entry:
            values = [float(entry.get(k, math.nan)) for k in ("rps", "p50_ms", "p99_ms")]
            rps, p50, p99 = values
            lines.append(
                f"{key:<30} {rps:>10.1f} {p50:>9.2f} {p99:>9.2f} {entry.get('errors', 0):>7}"
            )
    return lines


def ratio_table(ratios: list[Ratio]) -> list[str]:
    lines = [f"{'ratio':<52} {'value':>8} {'target':>8}  {'':<4}"]
    for ratio in ratios:
        verdict = {True: "ok", False: "MISS", None: "" if ratio.target == "-" else "n/a"}[
            ratio.passed
        ]
        lines.append(f"{ratio.name:<52} {fmt(ratio.value):>8} {ratio.target:>8}  {verdict:<4}")
        lines.append(f"    {ratio.detail}")
    return lines


def facts_table(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key in ("cache.cold", "cache.warm"):
        if key in results:
            lines.append(f"{key}: {results[key]}")
    cold, warm = results.get("cache.cold"), results.get("cache.warm")
    if cold and warm and warm.get("load_ms_max"):
        lines.append(
            f"compile cache: cold/warm load = {cold['load_ms_max'] / warm['load_ms_max']:.2f}x"
        )
    for size in (1, 16, 64):
        mesh = results.get(f"large.mesh.{size}MB")
        raw = results.get(f"large.broker.{size}MB")
        if mesh:
            ok = "ok" if mesh["errors"] == 0 else f"FAILED: {mesh['first_error'][:160]}"
            vs = _div(
                _get(results, f"large.mesh.{size}MB", "p50_ms"),
                _get(results, f"large.broker.{size}MB", "p50_ms"),
            )
            raw_ms = fmt(raw["p50_ms"] if raw else None)
            lines.append(
                f"large {size} MB: mesh p50 {fmt(mesh['p50_ms'])} ms, raw broker round "
                f"trip {raw_ms} ms, mesh/raw {fmt(vs)} ({ok})"
            )
    lines += allreduce_lines(results)
    lines += [f"{key}: {value}" for key, value in results.items() if key.startswith("quality.")]
    for name, entry in (results.get("memory") or {}).items():
        lines.append(f"memory {name}: RSS {entry['rss_mb']} MB, slice {entry['slice_mb']} MB")
    return lines


def allreduce_lines(results: dict[str, Any]) -> list[str]:
    """Leader vs sharded allreduce per rank count and part size (``allreduce`` scenario)."""
    lines: list[str] = []
    pattern = re.compile(r"^allreduce\.r(\d+)\.leader\.(\d+)KiB$")
    for key in sorted(results, key=lambda k: [int(n) for n in re.findall(r"\d+", k)]):
        match = pattern.match(key)
        sharded = results.get(key.replace(".leader.", ".sharded."))
        if match is None or not sharded:
            continue
        leader_ms, sharded_ms = results[key]["ms_per_allreduce"], sharded["ms_per_allreduce"]
        lines.append(
            f"allreduce {match[1]} ranks, {match[2]} KiB parts: leader {fmt(leader_ms)} ms, "
            f"sharded {fmt(sharded_ms)} ms, leader/sharded {fmt(_div(leader_ms, sharded_ms))}"
        )
    return lines


def render(results: dict[str, Any], ratios: list[Ratio], notes: list[str]) -> str:
    parts = ["", *load_table(results), "", *bar_table(results), "", *bar_table(results, REAL)]
    parts += ["", *generation_table(results)]
    parts += [""]
    parts += [*ratio_table(ratios), "", *facts_table(results)]
    parts += [f"note: {n}" for n in notes]
    return "\n".join(parts)


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(
    path: Path,
    results: dict[str, Any],
    ratios: list[Ratio],
    meta: dict[str, Any],
    rounds: list[dict[str, Any]] | None = None,
) -> None:
    """The run as JSON; with several rounds, each round's own results too."""
    doc: dict[str, Any] = {
        "meta": {**meta, "python": platform.python_version(), "machine": platform.machine()},
        "results": results,
        "ratios": [{**asdict(r), "passed": r.passed} for r in ratios],
    }
    if rounds is not None:
        doc["rounds"] = rounds
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
