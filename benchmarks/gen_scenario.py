"""The ``generate`` scenario: vLLM's serving metrics for the two benchmark checkpoints on
the mesh (TP 1, TP 2, 2 stages; one onnxruntime thread per rank) against the floor
(``gen_floor``: the unsliced model in one process, one sequence and a static batch of 32)
and the peer (``gen_peer``: transformers' ``generate`` behind aiohttp, one request at a time).

Every figure is recorded under ``gen.<model>.<target>.<load label>`` (``gen.large.mesh-tp1.
in32-out64.c32``); ``gen.targets`` names the loads the ratios of ``gen_report`` compare, and
``gen.<model>.memory`` the agents' RSS beside their slice and KV budget.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import gen_models
from benchmarks.gen_client import GenLoad, run_gen_load
from benchmarks.gen_metrics import summarize_traces
from benchmarks.meshes import Mesh, Process, running_mesh
from benchmarks.run import Run
from shardserve.ops.child_mesh import free_port, rss_bytes
from shardserve.repo.repository import load_group
from shardserve.runtime.kv_shape import cache_shape

ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_MB = 256  # every agent's KV budget: stated, so the memory target can use it
# A request's default deadline is 30 s; 32 large-model sequences on a busy 2-core machine
# take longer than that end to end (every one failed "deadline exceeded" at TP 2).
MESH_ENV = {
    "SHARDSERVE_AGENT_KV_CACHE_MB": str(KV_CACHE_MB),
    "SHARDSERVE_GATEWAY_DEFAULT_TIMEOUT": "600",
}
# target -> (ranks, stages, scheduler environment). ``mesh-tp1-step1`` is the design the
# decode runs replaced, kept in the run to decide between them (issue 29: "measure both"):
# the scheduler on every token's path, one decode step per StepWork.
LAYOUTS: dict[str, tuple[int, int, dict[str, str]]] = {
    "mesh-tp1": (1, 1, {}),
    "mesh-tp1-step1": (1, 1, {"SHARDSERVE_SCHEDULER_MAX_DECODE_STEPS": "1"}),
    "mesh-tp2": (2, 1, {}),
    "mesh-pp2": (2, 2, {}),
}


@dataclass(frozen=True)
class ModelPlan:
    """What is measured for one model: its loads, and which of them each target runs."""

    model: str
    loads: tuple[GenLoad, ...]
    reduced: tuple[str, ...]  # load labels run on TP 2 and 2 stages (TP 1 runs them all)

    @property
    def short(self) -> str:
        return self.model.removeprefix("bench-")

    def single(self) -> list[GenLoad]:
        """The one-sequence loads (the floor's batch 1, and the peer's)."""
        return [load for load in self.loads if load.max_concurrency == 1]


def plans(quick: bool) -> list[ModelPlan]:
    if quick:
        small = _loads((32, 32), requests=2) + (GenLoad(32, 32, 8, 32, rate=2.0, warmup=0),)
        large = _loads((16, 16), requests=2)
        return [
            ModelPlan("bench-small", small, ("in32-out32.c1",)),
            ModelPlan("bench-large", large, ("in16-out16.c1", "in16-out16.c32")),
        ]
    small = _loads((128, 128), 4) + _loads((32, 64), 4)
    small += (GenLoad(128, 128, 32, 32, rate=4.0, warmup=0),)
    large = _loads((32, 64), 3) + (GenLoad(32, 64, 16, 32, rate=1.0, warmup=0),)
    return [
        ModelPlan("bench-small", small, ("in128-out128.c1", "in32-out64.c1")),
        ModelPlan("bench-large", large, ("in32-out64.c1", "in32-out64.c32")),
    ]


def _loads(lengths: tuple[int, int], requests: int) -> tuple[GenLoad, ...]:
    """One sequence at a time (``requests`` of them), then 32 requests at 32 at once."""
    inp, out = lengths
    return (GenLoad(inp, out, requests, 1), GenLoad(inp, out, 32, 32, warmup=1))


def generate(run: Run) -> None:
    """The whole generation benchmark (``--only generate``)."""
    chosen = plans(run.quick)
    run.results["gen.targets"] = _target_labels(chosen)
    for plan in chosen:
        guarded(run, f"{plan.short} floor", partial(_floor, run, plan))
        guarded(run, f"{plan.short} peer", partial(_peer, run, plan))
        for target, (ranks, stages, env) in LAYOUTS.items():
            loads = [x for x in plan.loads if target == "mesh-tp1" or x.label in plan.reduced]
            mesh_part = partial(_mesh, run, plan, target, (ranks, stages), env, loads)
            guarded(run, f"{plan.short} {target}", mesh_part)


def raise_failures(run: Run) -> None:
    """After every part ran: the scenario fails when any part did."""
    if run.results.get("gen.failed"):
        raise RuntimeError(f"{len(run.results['gen.failed'])} part(s) failed (see the notes)")


def guarded(run: Run, name: str, part: Callable[[], None]) -> None:
    """One failing part (a peer that cannot start, a mesh that fails) must not lose the
    others' figures; the failure is a note of the run and fails the scenario at the end."""
    try:
        part()
    except Exception as exc:
        message = f"generate {name} failed: {type(exc).__name__}: {str(exc)[:1500]}"
        run.notes.append(message)
        run.results.setdefault("gen.failed", []).append(message)
        print(f"  {message}", flush=True)


def _target_labels(chosen: list[ModelPlan]) -> dict[str, str]:
    small, large = chosen
    return {
        "small.c1": small.single()[0].label,
        "large.c1": large.single()[0].label,
        "large.c32": large.reduced[1],
    }


def record(run: Run, key: str, summary: dict[str, Any]) -> None:
    summary["loadavg_1m"] = round(os.getloadavg()[0], 2)
    run.results[key] = summary
    itl, ttft = summary["itl_ms"], summary["ttft_ms"]
    print(
        f"  {key:<44} ttft {ttft['median']:9.1f} ms  itl {itl['median']:7.2f} ms "
        f"(p99 {itl['p99']:7.2f})  {summary['output_throughput']:8.1f} tok/s  "
        f"{summary['request_throughput']:6.2f} req/s  failed {summary['failed']}",
        flush=True,
    )


# ---------------------------------------------------------------- floor


def _floor(run: Run, plan: ModelPlan) -> None:
    repo = gen_models.exported(plan.model, 1, 1)
    for load in plan.single():
        requests = 1 if run.quick else 3
        for batch, name in ((1, "floor"), (32, "floor-b32")):
            summary = floor_run(repo, plan.model, load, batch, requests if batch == 1 else 1)
            label = replace(load, max_concurrency=batch).label
            record(run, f"gen.{plan.short}.{name}.{label}", summary)


def floor_run(repo: Path, model: str, load: GenLoad, batch: int, requests: int) -> dict[str, Any]:
    """``benchmarks.gen_floor`` in a process of its own (its RSS is the model's alone)."""
    command = [sys.executable, "-m", "benchmarks.gen_floor", "--repo", str(repo)]
    command += ["--model", model, "--input-len", str(load.input_len)]
    command += ["--output-len", str(load.output_len), "--batch", str(batch)]
    command += ["--requests", str(requests), "--seed", str(load.seed)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"gen_floor failed ({done.returncode}): {done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


# ---------------------------------------------------------------- peer


def _peer(run: Run, plan: ModelPlan) -> None:
    folder = gen_models.checkpoints() / plan.model
    port = free_port()
    # -P: not benchmarks/ first on sys.path, where profile.py would shadow the standard
    # library's (torch imports cProfile, which imports profile).
    script = str(ROOT / "benchmarks" / "gen_peer.py")
    argv = [str(gen_models.torch_python()), "-P", script]
    argv += ["--model", str(folder), "--port", str(port)]
    log = run.logs / f"peer-{plan.model}-{port}.log"
    process = Process(argv, dict(os.environ), log)
    process.start()
    try:
        process.wait_http_ready(f"http://127.0.0.1:{port}/ready", 300.0)
        for load in plan.single():
            peer_load = replace(load, requests=min(load.requests, 2))
            traces = asyncio.run(run_gen_load(f"http://127.0.0.1:{port}", plan.model, peer_load))
            record(run, f"gen.{plan.short}.peer.{load.label}", summarize_traces(traces))
    finally:
        process.stop()


# ---------------------------------------------------------------- mesh


def _mesh(
    run: Run,
    plan: ModelPlan,
    target: str,
    layout: tuple[int, int],
    env: dict[str, str],
    loads: list[GenLoad],
) -> None:
    repo = gen_models.exported(plan.model, *layout)
    with running_mesh(
        repo,
        run.amqp_url,
        run.logs,
        env={**MESH_ENV, **env},
        up_args=("--threads", "1"),
        ready_timeout=600,
    ) as mesh:
        run.results[f"gen.{plan.short}.{target}.ready_s"] = round(mesh.ready_s, 2)
        for load in loads:
            before = rank_totals(mesh, plan.model)
            traces = asyncio.run(run_gen_load(mesh.http_url, plan.model, load))
            summary = summarize_traces(traces)
            summary["rank_step_ms"] = step_budget(before, rank_totals(mesh, plan.model))
            record(run, f"gen.{plan.short}.{target}.{load.label}", summary)
        time.sleep(1.5)  # a heartbeat carries the KV figures after the loads
        run.results[f"gen.{plan.short}.{target}.memory"] = memory_facts(repo, plan.model, mesh)


def rank_totals(mesh: Mesh, model: str, settle_s: float = 1.5) -> dict[str, dict[str, float]]:
    """Every rank's step count and compute / collective-wait ms so far, as its last
    heartbeat reported them (after ``settle_s``, so the last steps are in)."""
    time.sleep(settle_s)
    keys = ("jobs_done", "compute_ms_total", "collective_ms_total")
    return {
        f"r{entry['rank']}": {key: float(entry.get(key) or 0.0) for key in keys}
        for entry in mesh.ranks(model)
    }


def step_budget(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per rank, over the steps between two readings: ms computing (the stage program but
    its collectives: onnxruntime, attention, sampling, digests) and ms waiting in
    collectives, per step."""
    budget: dict[str, dict[str, float]] = {}
    for rank, now in after.items():
        was = before.get(rank, {})
        steps = now["jobs_done"] - was.get("jobs_done", 0.0)
        if steps <= 0:
            continue
        budget[rank] = {
            "steps": steps,
            "compute_ms": round(
                (now["compute_ms_total"] - was.get("compute_ms_total", 0)) / steps, 3
            ),
            "collective_ms": round(
                (now["collective_ms_total"] - was.get("collective_ms_total", 0)) / steps, 3
            ),
        }
    return budget


def memory_facts(repo: Path, model: str, mesh: Mesh) -> dict[str, Any]:
    """Per rank: agent RSS, slice bytes on disk, KV budget and bytes per token."""
    group = load_group(repo, model, 1)
    facts: dict[str, Any] = {}
    for entry in mesh.ranks(model):
        rank = int(entry["rank"])
        folder = repo / model / "1" / f"rank_{rank}"
        weights = sum(p.stat().st_size for p in folder.glob("*") if p.is_file())
        facts[f"r{rank}"] = {
            "rss_mb": round(rss_bytes(int(entry.get("pid") or 0)) / 2**20, 1),
            "slice_mb": round(weights / 2**20, 1),
            "kv_budget_mb": round(int(entry.get("kv_capacity_bytes") or 0) / 2**20, 1),
            "kv_bytes_per_token": cache_shape(group, rank).bytes_per_token,
        }
    return facts
