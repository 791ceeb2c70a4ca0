"""Where a generation decode step's time goes: py-spy on every service of a mesh while one
(or N) sequences stream.

    .venv/bin/pip install py-spy   # a profiling tool, not a dependency of shardserve
    python -m benchmarks.gen_profile [--model bench-small] [--rank-size 1] [--stage-size 1]
        [--concurrency 1] [--seconds 15] [--output-len 128] [--threads 1]
        [--repo REPO --name SERVABLE]   # any exported repository instead

The mesh runs like the benchmark's (``--threads 1`` unless told, the same KV budget); requests of 32
prompt tokens keep it decoding. Printed per service: busy share of one core, the inclusive
share of the step path's frames, the top inclusive frames and leaves (raw profiles kept).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import gen_models
from benchmarks.gen_client import GenLoad, run_gen_load
from benchmarks.gen_metrics import Trace, summarize_traces
from benchmarks.gen_scenario import MESH_ENV, rank_totals, step_budget
from benchmarks.meshes import dedicated_vhost, running_mesh, service_pids
from benchmarks.profile import parse_collapsed

STEP_FRAMES = (
    ("_run", "steps.py"),
    ("run_stage", "program.py"),
    ("run_sync", "program.py"),
    ("_attend", "program.py"),
    ("_combined", "program.py"),
    ("_at_leader", "program.py"),
    ("finished", "work_checks.py"),
    ("digest_problem", "work_checks.py"),
    ("sample_rows", "sampling.py"),
    ("publish_raw", "broker.py"),
    ("_dispatch", "broker.py"),
    ("data_received", "lean.py"),
    ("publish", "lean.py"),
    ("encode", "codec.py"),
    ("decode", "codec.py"),
    ("select", "selectors.py"),
)


def summarize(name: str, text: str, seconds: float, rate: int) -> list[str]:
    total, inclusive, leaves = parse_collapsed(text)
    busy = 100.0 * total / max(seconds * rate, 1)
    lines = [f"== {name}: {total} samples, busy {busy:.0f}% of one core"]
    for func, file in STEP_FRAMES:
        count = sum(v for (f, fl), v in inclusive.items() if f.endswith(func) and fl == file)
        if count:
            lines.append(f"  {100.0 * count / max(total, 1):5.1f}%  {func} ({file})")
    lines.append("  top inclusive:")
    for (func, file), count in inclusive.most_common(25):
        lines.append(f"  {100.0 * count / max(total, 1):5.1f}%  {func} ({file})")
    lines.append("  top leaves:")
    for leaf, count in leaves.most_common(10):
        lines.append(f"  {100.0 * count / max(total, 1):5.1f}%  {leaf}")
    return lines


def _spy(py_spy: str, pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen[bytes]:
    argv = [py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate)]
    argv += ["-f", "raw", "--nonblocking", "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _keep_decoding(url: str, model: str, args: argparse.Namespace) -> list[Trace]:
    traces: list[Trace] = []
    stop = time.perf_counter() + args.seconds
    while time.perf_counter() < stop:
        load = GenLoad(32, args.output_len, args.concurrency, args.concurrency, warmup=0)
        traces += await run_gen_load(url, model, load)
    return traces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gen_profile")
    parser.add_argument("--model", default="bench-small")
    parser.add_argument("--rank-size", type=int, default=1)
    parser.add_argument("--stage-size", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--threads", default="1", help="shardserve up --threads")
    parser.add_argument("--repo", type=Path, help="profile this repository's servable...")
    parser.add_argument("--name", help="...of this name instead of a benchmark model")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    if args.repo is not None:
        repo, args.model = args.repo, args.name or args.model
    else:
        repo = gen_models.exported(args.model, args.rank_size, args.stage_size)
    work = Path(tempfile.mkdtemp(prefix="shardserve-gen-profile-"))
    (work / "logs").mkdir()
    up_args = ("--threads", args.threads)
    with (
        dedicated_vhost() as url,
        running_mesh(repo, url, work / "logs", env=MESH_ENV, up_args=up_args) as mesh,
    ):
        # One warm-up sequence, so sessions and caches are hot before sampling.
        asyncio.run(run_gen_load(mesh.http_url, args.model, GenLoad(32, 8, 1, 1, warmup=0)))
        pids = service_pids(mesh.process.pid)
        spies = {
            n: _spy(py_spy, p, args.seconds, args.rate, work / f"{n}.txt") for n, p in pids.items()
        }
        before = rank_totals(mesh, args.model, settle_s=0.0)
        traces = asyncio.run(_keep_decoding(mesh.http_url, args.model, args))
        budget = step_budget(before, rank_totals(mesh, args.model))
        for spy in spies.values():
            spy.wait()
    summary = summarize_traces(traces)
    print(f"under py-spy: itl {summary['itl_ms']} ms, {summary['output_throughput']} tok/s")
    print(f"per step on each rank (agents' own accounting): {budget}")
    for name in spies:
        path = work / f"{name}.txt"
        text = path.read_text() if path.exists() else ""
        print("\n".join(summarize(name, text, args.seconds, args.rate)))
    print(f"raw profiles: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
