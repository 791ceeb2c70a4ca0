"""The measured scenarios, one function each, registered by name in ``SCENARIOS``.

Each scenario records ``LoadResult``s (or plain facts) into ``Run.results`` under stable
keys (``floor.json.c32``, ``mesh1.binary.c1``...); ``report`` turns them into ratios.
Meshes run the demo matmul model (x FP32 [128, 96], 48 KiB in, 8 KiB out) unless the
scenario is about something else (the MLP for batching/pipelining/memory, a wide MLP for
large tensors, the transformer for the compile cache).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.bodies import Body, make_body, matmul_input, mlp_input
from benchmarks.broker_hop import Requester
from benchmarks.ceilings import batching_ceiling, pipeline_ceiling
from benchmarks.grpc_client import infer_request, load_grpc
from benchmarks.loadgen import LoadResult, LoadSpec, load_http, run_load, summarize
from benchmarks.meshes import (
    CpuMeter,
    Mesh,
    broker_pid,
    running_module,
    service_pids,
)
from benchmarks.run import Run
from shardserve.ops.child_mesh import free_port, rss_bytes

MATMUL_IN_BYTES = 128 * 96 * 4
MATMUL_OUT_BYTES = 128 * 16 * 4
MLP_HIDDEN, MLP_FFN, MLP_LAYERS = 1024, 4096, 2
BATCH_MLP_LAYERS = 1  # the batching target's model: "MLP 1024->4096->1024", one block
BATCH_CLIENTS = 32
PIPELINE_CLIENTS = 8  # max-inflight 1 queues 10 jobs at most: more clients would be refused
LARGE_SIZES_MB = (1, 16, 64)
ALLREDUCE_RANKS = (4, 8)
ALLREDUCE_SIZES_KIB = (256, 1024, 4096, 8192, 16384)
WIDE_HIDDEN = 4096  # the large-tensor model: rows of 16 KiB, almost no compute
NO_BATCHING = {"SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE": "1"}


# ---------------------------------------------------------------- models and repos


def matmul_repo(run: Run, rank_size: int, stage_size: int = 1) -> Path:
    from shardserve.tools.export.matmul import export_matmul

    return run.repo(
        f"matmul-r{rank_size}-s{stage_size}",
        lambda out: export_matmul(out, rank_size=rank_size, stage_size=stage_size),
    )


def mlp_repo(
    run: Run,
    rank_size: int = 1,
    stage_size: int = 1,
    *,
    hidden: int = MLP_HIDDEN,
    ffn: int = MLP_FFN,
    layers: int = MLP_LAYERS,
) -> Path:
    from shardserve.tools.export.mlp import export_mlp

    key = f"mlp-r{rank_size}-s{stage_size}-{hidden}-{ffn}-{layers}"
    return run.repo(
        key,
        lambda out: export_mlp(
            out,
            rank_size=rank_size,
            stage_size=stage_size,
            hidden=hidden,
            ffn=ffn,
            layers=layers,
        ),
    )


def slice_path(repo: Path, servable: str, rank: int) -> Path:
    """The one segment file of ``rank`` in an exported repository (version 1), as its group
    config names it."""
    from shardserve.repo.repository import load_group, rank_dir

    [name] = load_group(repo, servable, 1).ranks[rank].files
    return rank_dir(repo, servable, 1, rank) / name


def reference_onnx(run: Run, name: str, model: onnx.ModelProto) -> Path:
    path = run.work / "models" / f"{name}.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
    return path


def matmul_reference(run: Run) -> Path:
    from shardserve.tools.export.matmul import reference_model

    return reference_onnx(run, "matmul", reference_model())


# ---------------------------------------------------------------- helpers


def http_load(
    run: Run,
    key: str,
    url: str,
    body: Body,
    concurrency: int,
    pids: dict[str, int] | None = None,
) -> LoadResult:
    """One load point; with ``pids``, also the CPU ms each process spent per request
    (CPU over the whole run, warm-up included, divided by every call it made)."""
    meter = CpuMeter({**(pids or {}), "loadgen": os.getpid()})
    result = asyncio.run(load_http(url, body.data, body.headers, run.spec(concurrency)))
    cpu = meter.per_request(result.calls_total) if pids else {}
    run.record(key, result, body_bytes=len(body.data), body=body.kind, cpu_ms_per_request=cpu)
    if cpu:
        print(f"    cpu ms/request: {cpu}", flush=True)
    return result


def load_matrix(
    run: Run,
    prefix: str,
    url: str,
    points: list[tuple[str, int]],
    inputs: dict[str, np.ndarray],
    pids: dict[str, int] | None = None,
) -> None:
    """Measure every (body kind, concurrency) point against one URL."""
    for kind, concurrency in points:
        body = make_body(kind, inputs)
        http_load(run, f"{prefix}.{kind}.c{concurrency}", url, body, concurrency, pids)


def mesh_pids(mesh: Mesh) -> dict[str, int]:
    """The mesh's service processes plus the broker, for CPU accounting."""
    pids = service_pids(mesh.process.pid)
    rabbit = broker_pid()
    return {**pids, "rabbitmq": rabbit} if rabbit else pids


def full_points(run: Run) -> list[tuple[str, int]]:
    return [("json", 1), ("json", 32), ("binary", 1), ("binary", 32)]


def agent_pids(mesh: Mesh, servable: str) -> dict[int, int]:
    return {int(r["rank"]): int(r["pid"]) for r in mesh.ranks(servable) if r.get("pid")}


# ---------------------------------------------------------------- scenarios


def direct(run: Run) -> None:
    """onnxruntime in-process on the unsliced matmul: compute only, one caller."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(matmul_reference(run)), opts)
    feed = matmul_input()
    spec = run.spec(1)
    for _ in range(200):
        session.run(None, feed)
    latencies: list[float] = []
    stop = time.perf_counter() + spec.duration_s
    while (began := time.perf_counter()) < stop:
        session.run(None, feed)
        latencies.append((time.perf_counter() - began) * 1000)
    elapsed = sum(latencies) / 1000
    run.record("direct.c1", summarize(1, latencies, 0, elapsed, ""))


def floor(run: Run) -> None:
    """The floor server (aiohttp + onnxruntime, one process) on the unsliced matmul,
    parsing JSON with orjson."""
    _floor(run, "floor", "fast")


def floor_numeric(run: Run) -> None:
    """The same floor server reading JSON as the gateway does (numeric_json)."""
    _floor(run, "floor-numeric", "numeric")


def floor_stdlib(run: Run) -> None:
    """The same floor server with Python's json module: what a plain server does."""
    _floor(run, "floor-stdlib", "stdlib")


def _floor(run: Run, prefix: str, json_lib: str) -> None:
    port = free_port()
    args = ["--model", str(matmul_reference(run)), "--port", str(port), "--json", json_lib]
    ready = f"http://127.0.0.1:{port}/v2/health/ready"
    with running_module("benchmarks.floor_server", args, run.logs, ready, {}) as server:
        url = f"http://127.0.0.1:{port}/v2/models/matmul/infer"
        pids = {"floor": server.pid}
        load_matrix(run, prefix, url, full_points(run), matmul_input(), pids)


def gateway_alone(run: Run) -> None:
    """The gateway with the broker replaced by an in-process answer, and a bare aiohttp
    handler (``benchmarks.gateway_alone``): what the gateway's HTTP side costs alone."""
    for variant in ("gateway", "bare"):
        port = free_port()
        args = ["--variant", variant, "--port", str(port)]
        ready = f"http://127.0.0.1:{port}/v2/health/ready"
        with running_module("benchmarks.gateway_alone", args, run.logs, ready, {}) as server:
            url = f"http://127.0.0.1:{port}/v2/models/matmul/infer"
            points = [("binary", 32), ("json", 32)]
            pids = {variant: server.pid}
            load_matrix(run, f"gateway-alone.{variant}", url, points, matmul_input(), pids)


def broker(run: Run) -> None:
    """Raw request/reply over RabbitMQ (aio-pika) with the mesh's payload sizes."""
    queue = f"bench.hop.{free_port()}"
    args = ["--url", run.amqp_url, "--queue", queue, "--reply-bytes", str(MATMUL_OUT_BYTES)]
    with running_module("benchmarks.broker_hop", args, run.logs, None, {}) as responder:
        rabbit = broker_pid()
        pids = {"responder": responder.pid, **({"rabbitmq": rabbit} if rabbit else {})}
        for concurrency in (1, 32):
            meter = CpuMeter({**pids, "requester": os.getpid()})
            result = asyncio.run(_raw_round_trips(run, queue, MATMUL_IN_BYTES, concurrency))
            cpu = meter.per_request(result.calls_total)
            key = f"broker.c{concurrency}"
            run.record(key, result, request_bytes=MATMUL_IN_BYTES, cpu_ms_per_request=cpu)
            print(f"    cpu ms/request: {cpu}", flush=True)


async def _raw_round_trips(run: Run, queue: str, size: int, concurrency: int) -> LoadResult:
    payload = b"q" * size
    async with Requester(run.amqp_url, queue) as requester:

        async def call() -> bool:
            await requester.call(payload)
            return True

        return await run_load(call, run.spec(concurrency))


def mesh1(run: Run) -> None:
    """The mesh at rank_size 1 (matmul), JSON and binary, 1 and 32 clients."""
    with run.mesh(matmul_repo(run, 1)) as mesh:
        run.results["mesh1.ready_s"] = round(mesh.ready_s, 2)
        url = mesh.infer_url("matmul")
        load_matrix(run, "mesh1", url, full_points(run), matmul_input(), mesh_pids(mesh))


def tp8(run: Run) -> None:
    """Tensor parallel: matmul over 8 ranks in one stage (allgather over the broker)."""
    points = [("json", 32), ("binary", 32)] + ([] if run.quick else [("json", 1)])
    with run.mesh(matmul_repo(run, 8)) as mesh:
        run.results["tp8.ready_s"] = round(mesh.ready_s, 2)
        url = mesh.infer_url("matmul")
        load_matrix(run, "tp8", url, points, matmul_input(), mesh_pids(mesh))


def grpc_demo(run: Run) -> None:
    """The gRPC API beside REST binary on the demo (matmul over 8 ranks) at 1 and 32
    clients, the two interleaved point by point on one mesh."""
    inputs = matmul_input()
    body, request = make_body("binary", inputs), infer_request("matmul", inputs)
    with run.mesh(matmul_repo(run, 8), grpc=True) as mesh:
        url, address = mesh.infer_url("matmul"), f"127.0.0.1:{mesh.grpc_port}"
        pids = mesh_pids(mesh)
        for concurrency in (1, 32):
            http_load(run, f"grpc-demo.rest-binary.c{concurrency}", url, body, concurrency, pids)
            grpc_load(run, f"grpc-demo.grpc.c{concurrency}", address, request, concurrency, pids)


def grpc_load(
    run: Run, key: str, address: str, request: bytes, concurrency: int, pids: dict[str, int]
) -> LoadResult:
    """One gRPC load point, with the CPU ms each process spent per request."""
    meter = CpuMeter({**pids, "loadgen": os.getpid()})
    result = asyncio.run(load_grpc(address, request, run.spec(concurrency)))
    cpu = meter.per_request(result.calls_total)
    run.record(key, result, body_bytes=len(request), body="grpc", cpu_ms_per_request=cpu)
    print(f"    cpu ms/request: {cpu}", flush=True)
    return result


def pp16(run: Run) -> None:
    """16 ranks in 2 stages of 8 (MatMul stage, then Neg stage, allgather in each)."""
    points = [("json", 32), ("binary", 32)] + ([] if run.quick else [("json", 1)])
    with run.mesh(matmul_repo(run, 16, 2)) as mesh:
        run.results["pp16.ready_s"] = round(mesh.ready_s, 2)
        load_matrix(run, "pp16", mesh.infer_url("matmul"), points, matmul_input())


def batching(run: Run) -> None:
    """The issue's MLP, 1024->4096->1024 (one block), one row per request, 32 clients:
    dynamic batching on (up to 32 rows per job) vs off (max batch size 1). The same for the
    two-block MLP of the pipeline and memory scenarios (``mlp2.*``), for comparison."""
    for prefix, layers in (("mlp", BATCH_MLP_LAYERS), ("mlp2", MLP_LAYERS)):
        repo = mlp_repo(run, 1, layers=layers)
        seconds = run.spec(1).duration_s / 4  # x2 tries x2 measurements
        run.results[f"{prefix}.ceiling"] = batching_ceiling(
            slice_path(repo, "mlp", 0), BATCH_CLIENTS, seconds
        )
        _batching(run, prefix, repo)


def _batching(run: Run, prefix: str, repo: Path) -> None:
    body = make_body("binary", mlp_input(1, MLP_HIDDEN))
    variants = {
        "batched": {
            "SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE": str(BATCH_CLIENTS),
            "SHARDSERVE_SCHEDULER_MAX_BATCH_DELAY_MS": "2",
        },
        "unbatched": NO_BATCHING,
    }
    for name, env in variants.items():
        with run.mesh(repo, env) as mesh:
            key = f"{prefix}.{name}.c{BATCH_CLIENTS}"
            http_load(run, key, mesh.infer_url("mlp"), body, BATCH_CLIENTS, mesh_pids(mesh))
            run.results[f"{prefix}.{name}.batches"] = _batch_counters(mesh, "mlp")


def _batch_counters(mesh: Mesh, servable: str) -> dict[str, Any]:
    for entry in mesh.status().get("servables", ()):
        if entry.get("name") == servable:
            keys = ("requests_total", "batches_total", "batched_instances_total")
            return {k: entry.get(k) for k in keys}
    return {}


def pipeline(run: Run) -> None:
    """The MLP cut in 2 stages (1 rank each), batching off, 8 clients: jobs in flight
    unbounded (stage 0 works on job n+1 while stage 1 works on job n) vs max-inflight 1."""
    repo = mlp_repo(run, 2, 2)
    stages = [slice_path(repo, "mlp", rank) for rank in (0, 1)]
    run.results["pipeline.ceiling"] = pipeline_ceiling(stages, run.spec(1).duration_s / 4)
    body = make_body("binary", mlp_input(1, MLP_HIDDEN))
    variants = {
        "pipelined": dict(NO_BATCHING),
        "serial": {**NO_BATCHING, "SHARDSERVE_SCHEDULER_MAX_INFLIGHT": "1"},
    }
    for name, env in variants.items():
        with run.mesh(repo, env) as mesh:
            key = f"pipeline.{name}.c{PIPELINE_CLIENTS}"
            http_load(run, key, mesh.infer_url("mlp"), body, PIPELINE_CLIENTS, mesh_pids(mesh))


def memory(run: Run) -> None:
    """Agent RSS vs the bytes of its slice's weights: the MLP whole (rank 1) and split over
    2 ranks, against the fixed overhead of an agent with a tiny slice (matmul, 24 KiB)."""
    repo = run.work / "repos" / "memory"
    if not repo.exists():
        from shardserve.tools.export.matmul import export_matmul
        from shardserve.tools.export.mlp import export_mlp

        export_matmul(repo, rank_size=1)
        export_mlp(repo, name="mlp", hidden=MLP_HIDDEN, ffn=MLP_FFN, layers=MLP_LAYERS)
        export_mlp(repo, name="mlp_tp2", rank_size=2, hidden=MLP_HIDDEN, ffn=MLP_FFN)
    with run.mesh(repo) as mesh:
        warm = {"matmul": matmul_input(), "mlp": mlp_input(8, MLP_HIDDEN)}
        warm["mlp_tp2"] = warm["mlp"]
        for servable, inputs in warm.items():
            body = make_body("binary", inputs)
            asyncio.run(load_http(mesh.infer_url(servable), body.data, body.headers, _few(20)))
        time.sleep(1.5)  # let a heartbeat carry the post-warm-up RSS too
        run.results["memory"] = _memory_facts(repo, mesh)
    facts = run.results["memory"]
    for name, entry in facts.items():
        print(f"  memory {name:<14} {entry}", flush=True)


def _few(count: int) -> LoadSpec:
    return LoadSpec(concurrency=1, duration_s=60.0, warmup_s=0.0, max_requests=count)


def _memory_facts(repo: Path, mesh: Mesh) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for servable in ("matmul", "mlp", "mlp_tp2"):
        for rank, pid in sorted(agent_pids(mesh, servable).items()):
            weights = sum(
                p.stat().st_size for p in (repo / servable / "1" / f"rank_{rank}").glob("*")
            )
            facts[f"{servable}.r{rank}"] = {
                "rss_mb": round(rss_bytes(pid) / 2**20, 1),
                "slice_mb": round(weights / 2**20, 2),
            }
    return facts


def large(run: Run) -> None:
    """1, 16 and 64 MB tensors through the mesh (binary body, binary output) on a wide
    one-block MLP (hidden 4096, ffn 8: the bytes dominate, not the compute), against a
    raw broker round trip of the same size."""
    repo = mlp_repo(run, 1, 1, hidden=WIDE_HIDDEN, ffn=8, layers=1)
    env = {**NO_BATCHING, "SHARDSERVE_GATEWAY_MAX_BODY_MB": "200"}
    count = 3 if run.quick else 6
    with run.mesh(repo, env) as mesh:
        for size in LARGE_SIZES_MB:
            rows = size * 2**20 // (WIDE_HIDDEN * 4)
            body = make_body("binary", mlp_input(rows, WIDE_HIDDEN))
            result = asyncio.run(
                load_http(mesh.infer_url("mlp"), body.data, body.headers, _few(count))
            )
            run.record(f"large.mesh.{size}MB", result, tensor_mb=size)
    queue = f"bench.large.{free_port()}"
    for size in LARGE_SIZES_MB:
        nbytes = size * 2**20
        args = ["--url", run.amqp_url, "--queue", queue, "--reply-bytes", str(nbytes)]
        with running_module("benchmarks.broker_hop", args, run.logs, None, {}):
            result = asyncio.run(_raw_few(run, queue, nbytes, count))
            run.record(f"large.broker.{size}MB", result, tensor_mb=size)


def allreduce(run: Run) -> None:
    """The agents' allreduce alone (``benchmarks.allreduce``: one process per rank over
    the broker, no model) at 4 and 8 ranks, leader vs sharded, on parts of 256 KiB to
    16 MiB: where sharding starts to pay (``collective.MIN_SHARD_BYTES``)."""
    count = 6 if run.quick else 15
    for ranks in ALLREDUCE_RANKS:
        version_dir = matmul_repo(run, ranks, 1) / "matmul" / "1"
        for kib in ALLREDUCE_SIZES_KIB:
            for algorithm in ("leader", "sharded"):
                timings = _allreduce_ranks(run, version_dir, ranks, algorithm, kib * 1024, count)
                per_job = float(np.median([np.mean(t[1:]) for t in timings]))  # [0]: warm-up
                key = f"allreduce.r{ranks}.{algorithm}.{kib}KiB"
                run.results[key] = {"ms_per_allreduce": round(per_job, 3)}
                print(f"  {key:<32} {per_job:9.2f} ms per allreduce", flush=True)


def _allreduce_ranks(
    run: Run, version_dir: Path, ranks: int, algorithm: str, size: int, count: int
) -> list[list[float]]:
    """Every rank's allreduce timings (ms) from one run of the rank processes."""
    run_id = f"ar{uuid.uuid4().hex[:10]}"
    common = ["--url", run.amqp_url, "--run", run_id, "--group-dir", str(version_dir)]
    common += ["--bytes", str(size), "--count", str(count), "--algorithm", algorithm]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.allreduce", *common, "--rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    timings: list[list[float]] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"allreduce rank failed ({proc.returncode}): {err[-2000:]}")
        timings.append(json.loads(out.strip().splitlines()[-1])["ms"])
    return timings


async def _raw_few(run: Run, queue: str, size: int, count: int) -> LoadResult:
    payload = b"q" * size
    async with Requester(run.amqp_url, queue) as requester:

        async def call() -> bool:
            await requester.call(payload)
            return True

        return await run_load(call, _few(count))


def cache(run: Run) -> None:
    """Compile cache: agent load time of the transformer with an empty cache folder (cold:
    optimize + save) and again with the folder it filled (warm: load the saved graph)."""
    from shardserve.tools.export.transformer import export_transformer

    repo = run.repo(
        "transformer",
        lambda out: export_transformer(
            out, rank_size=2, layers=4, hidden=256, heads=4, vocab=2048, max_seq=64
        ),
    )
    cache_dir = run.work / "compile-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)  # cold in every round, not just the first
    env = {"SHARDSERVE_AGENT_CACHE_DIR": str(cache_dir)}
    for phase in ("cold", "warm"):
        with run.mesh(repo, env) as mesh:
            ranks = mesh.ranks("transformer")
            loads = [float(r.get("load_ms") or 0.0) for r in ranks]
            logged = loaded_from_log(mesh.process.log_tail(400))
            if not all(loads) and logged:
                loads = [ms for ms, _ in logged]
            run.results[f"cache.{phase}"] = {
                "load_ms_per_rank": [round(v, 1) for v in loads],
                "load_ms_max": round(max(loads, default=0.0), 1),
                "cache": sorted({str(r.get("cache", "?")) for r in ranks} | {c for _, c in logged}),
                "mesh_ready_s": round(mesh.ready_s, 2),
            }
        print(f"  cache.{phase:<22} {run.results[f'cache.{phase}']}", flush=True)


_LOADED = re.compile(r"slice loaded: .*compile cache (\w+).* (\d+(?:\.\d+)?) ms$")


def loaded_from_log(text: str) -> list[tuple[float, str]]:
    """(load ms, cache outcome) of every "slice loaded" line an agent logged."""
    found = []
    for line in text.splitlines():
        match = _LOADED.search(line)
        if match:
            found.append((float(match.group(2)), match.group(1)))
    return found


def generate(run: Run) -> None:
    """Text generation: vLLM's serving metrics for Llama-shaped checkpoints on the mesh,
    against llama.cpp and onnxruntime-genai (``benchmarks.gen_bar``: the bar, first), an
    in-process floor and transformers (``benchmarks.gen_scenario``)."""
    from benchmarks.gen_bar import bar
    from benchmarks.gen_scenario import generate as generation_benchmark
    from benchmarks.gen_scenario import raise_failures

    bar(run)
    generation_benchmark(run)
    raise_failures(run)


def real(run: Run) -> None:
    """The bar on a real model (``benchmarks.gen_real``): SmolLM2-135M-Instruct's Q8_0 and
    Q4_0 files on llama-server and on the mesh, in the same run."""
    from benchmarks.gen_real import real as real_benchmark

    real_benchmark(run)


def quality(run: Run) -> None:
    """What ``--quantize`` costs (``benchmarks.quality``): perplexity and top-1 agreement
    against fp32 on a pre-trained checkpoint."""
    from benchmarks.quality import quality as quality_benchmark

    quality_benchmark(run)


SCENARIOS: dict[str, Callable[[Run], None]] = {
    "direct": direct,
    "floor": floor,
    "floor-numeric": floor_numeric,
    "floor-stdlib": floor_stdlib,
    "broker": broker,
    "gateway-alone": gateway_alone,
    "mesh1": mesh1,
    "tp8": tp8,
    "grpc": grpc_demo,
    "pp16": pp16,
    "batching": batching,
    "pipeline": pipeline,
    "memory": memory,
    "large": large,
    "allreduce": allreduce,
    "cache": cache,
    "generate": generate,
    "real": real,
    "quality": quality,
}
