"""The bar to beat (issue 35): one checkpoint (``bench-125m``), 2 threads for every system,
128-token prompts, in the same run:

- llama.cpp's ``llama-server`` on F32, Q8_0 and Q4_0 GGUF files of it (``gen_llama``);
- onnxruntime-genai's model builder export, run in process (``gen_ortgenai``): one sequence
  at a time, and a static batch of 32;
- the mesh at TP 1 (fp32, and int8 / int4 when the exporter can quantize) and TP 2;
- the machine's memory bandwidth (``gen_triad``) and each system's weight bytes per token,
  so the report puts bytes / bandwidth beside every c1 ITL.

Figures land under ``gen.bar.<system>.<load label>``, each system's facts (precision,
threads, RSS, weight bytes per token) under ``gen.bar.<system>.info``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import gen_llama, gen_models
from benchmarks.gen_client import GenLoad, random_prompts, run_gen_load
from benchmarks.gen_metrics import Trace, summarize_traces
from benchmarks.gen_scenario import (
    KV_CACHE_MB,
    MESH_ENV,
    guarded,
    memory_facts,
    rank_totals,
    record,
    step_budget,
)
from benchmarks.gen_triad import measure_bandwidth
from benchmarks.meshes import running_mesh
from benchmarks.run import Run
from benchmarks.weight_bytes import rank_bytes_per_token

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-125m"
THREADS = 2
NO_QUANTIZE = "not available: exporter has no --quantize"
# system -> (precision, ranks, threads per rank): THREADS in all, as every other system gets
# (``--threads 2`` at TP 1, 1 per rank at TP 2: stated, not left to ``auto``, whose share
# changed as the mesh learned to use every core); TP 1 at 1 thread for reference.
MESHES = {
    "mesh-tp1-fp32": ("fp32", 1, THREADS),
    "mesh-tp1-int8": ("int8", 1, THREADS),
    "mesh-tp1-int4": ("int4", 1, THREADS),
    "mesh-tp2-fp32": ("fp32", 2, THREADS // 2),
    "mesh-tp1-fp32-1t": ("fp32", 1, 1),
}


@dataclass(frozen=True)
class BarPlan:
    c1: GenLoad
    c32: GenLoad

    @property
    def tokens_per_sequence(self) -> int:
        return self.c1.input_len + self.c1.output_len


def bar_plan(quick: bool) -> BarPlan:
    """c1 and c32 on prompts of their own (seeds 0 and 1): llama-server would otherwise
    find c32's first prompts in its prompt cache, left there by c1."""
    out = 32 if quick else 128
    c1 = GenLoad(128, out, 2 if quick else 3, 1, warmup=1)
    return BarPlan(c1, GenLoad(128, out, 32, 32, warmup=1, seed=1))


def bar(run: Run) -> None:
    """Every system of the bar; a failing one is a note and fails the scenario at the end."""
    plan = bar_plan(run.quick)
    run.results["gen.bar.targets"] = {"c1": plan.c1.label, "c32": plan.c32.label}
    guarded(run, "bandwidth", partial(record_bandwidth, run, "gen.bar"))
    for precision in gen_llama.PRECISIONS:
        guarded(run, f"llama.cpp {precision}", partial(_llama, run, plan, precision))
    guarded(run, "onnxruntime-genai", partial(_ortgenai, run, plan))
    for system, (precision, ranks, threads) in MESHES.items():
        part = partial(_mesh, run, plan, system, precision, (ranks, threads))
        guarded(run, system, part)


def record_bandwidth(run: Run, prefix: str) -> None:
    """The triad's bandwidth at the bar's threads, as ``<prefix>.bandwidth``."""
    run.results[f"{prefix}.bandwidth"] = measure_bandwidth(THREADS)
    print(f"  triad bandwidth, {THREADS} threads: {run.results[f'{prefix}.bandwidth']}", flush=True)


def _info(run: Run, system: str, **facts: Any) -> None:
    run.results[f"gen.bar.{system}.info"] = {"threads": THREADS, **facts}


# ---------------------------------------------------------------- llama.cpp


def _llama(run: Run, plan: BarPlan, precision: str) -> None:
    gguf = gen_llama.gguf_file(MODEL, precision)
    weights = gen_llama.header(gguf).weight_bytes_per_token()
    system = f"llama-{precision}"
    log = run.logs / f"llama-server-{precision}.log"
    summaries, rss = gen_llama.measure_loads(gguf, THREADS, (plan.c1, plan.c32), log, MODEL)
    for label, summary in summaries.items():
        record(run, f"gen.bar.{system}.{label}", summary)
    _info(run, system, precision=precision, rss_mb=rss, weight_bytes_per_token=weights)


# ---------------------------------------------------------------- onnxruntime-genai


def ortgenai_model() -> Path:
    """The model builder's fp32 CPU export of the checkpoint (made when missing)."""
    key = gen_models.source_hash(gen_models.FIXTURE_SCRIPT)
    out = gen_models.cache_root() / f"ortgenai-{key}" / MODEL
    if (out / "genai_config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"  onnxruntime-genai model builder: {out}", flush=True)
    _ortgenai_call(["build", "--checkpoint", str(gen_models.checkpoints() / MODEL)], out)
    return out


def _ortgenai_call(args: list[str], out: Path) -> str:
    script = str(ROOT / "benchmarks" / "gen_ortgenai.py")
    command = [
        str(gen_models.torch_python()),
        "-P",
        script,
        *args,
        "--" + ("out" if args[0] == "build" else "model"),
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"gen_ortgenai {args[0]} failed ({done.returncode}): {done.stderr[-1500:]}"
        )
    return done.stdout


def _ortgenai(run: Run, plan: BarPlan) -> None:
    model = ortgenai_model()
    rss = 0.0
    for load, batch in ((plan.c1, 1), (plan.c32, 32)):
        # the client's measured prompts (it sends ``load.warmup`` others first)
        prompts = random_prompts(load.warmup + load.requests, load.input_len, load.seed)
        prompts = prompts[load.warmup :]
        path = run.work / f"ortgenai-prompts-{batch}.json"
        path.write_text(json.dumps(prompts))
        args = ["run", "--prompts", str(path), "--output-len", str(load.output_len)]
        args += ["--batch", str(batch), "--threads", str(THREADS)]
        answer = json.loads(_ortgenai_call(args, model).strip().splitlines()[-1])
        traces = [Trace(**trace) for trace in answer["traces"]]
        record(run, f"gen.bar.ortgenai.{load.label}", summarize_traces(traces))
        rss = max(rss, float(answer["rss_mb"]))
    weights = rank_bytes_per_token(model)
    _info(run, "ortgenai", precision="fp32", rss_mb=rss, weight_bytes_per_token=weights)


# ---------------------------------------------------------------- the mesh


def _mesh(run: Run, plan: BarPlan, system: str, precision: str, layout: tuple[int, int]) -> None:
    ranks, threads = layout
    quantize = None if precision == "fp32" else precision
    if quantize and not gen_models.exporter_quantizes():
        _info(run, system, precision=precision, skipped=NO_QUANTIZE)
        run.notes.append(f"gen bar {system}: {NO_QUANTIZE}")
        print(f"  {system}: {NO_QUANTIZE}", flush=True)
        return
    repo = gen_models.exported(MODEL, ranks, 1, quantize=quantize)
    up_args = ("--threads", str(threads))
    with running_mesh(
        repo, run.amqp_url, run.logs, env=MESH_ENV, up_args=up_args, ready_timeout=600
    ) as mesh:
        for load in (plan.c1, plan.c32):
            before = rank_totals(mesh, MODEL)
            traces = asyncio.run(run_gen_load(mesh.http_url, MODEL, load))
            summary = summarize_traces(traces)
            summary["rank_step_ms"] = step_budget(before, rank_totals(mesh, MODEL))
            record(run, f"gen.bar.{system}.{load.label}", summary)
        time.sleep(1.5)  # a heartbeat carries the KV figures after the loads
        memory = memory_facts(repo, MODEL, mesh)
    folder = repo / MODEL / "1"
    weights = max(rank_bytes_per_token(folder / f"rank_{r}") for r in range(ranks))
    rss = max(v["rss_mb"] for v in memory.values())
    _info(
        run,
        system,
        precision=precision,
        rss_mb=rss,
        weight_bytes_per_token=weights,
        memory=memory,
        kv_budget_mb=KV_CACHE_MB,
        threads=ranks * threads,
        threads_per_rank=threads,
    )
