"""Where a mesh request's CPU goes, per service: py-spy on every process under load.

    .venv/bin/pip install py-spy   # a profiling tool, not a dependency of shardserve
    python -m benchmarks.profile [--body json|binary] [--clients 32] [--seconds 12]
        [--model matmul|mlp] [--rank-size R] [--stage-size S] [--max-batch-size N]

Starts a mesh (the rank-1 matmul by default; TP8: ``--rank-size 8``; the pipeline
benchmark's model: ``--model mlp --rank-size 2 --stage-size 2 --max-batch-size 1``) on a
dedicated vhost, attaches ``py-spy record`` (raw collapsed stacks, 100 Hz) to the
gateway, the scheduler and every agent, drives the load, then prints per service the
share of samples (busy time) spent in the functions that matter: inclusive percentages
of a fixed list of hot-path frames, and the top leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.bodies import Body, make_body, matmul_input, mlp_input
from benchmarks.loadgen import LoadSpec, load_http
from benchmarks.meshes import dedicated_vhost, running_mesh, service_pids
from benchmarks.scenarios import MLP_FFN, MLP_HIDDEN, MLP_LAYERS

# Frames whose inclusive share answers "where does the time go" (function name, file).
HOT_FRAMES = (
    ("decode_request", "kserve_codec.py"),
    ("loads", "__init__.py"),
    ("encode_response", "kserve_codec.py"),
    ("dumps", "__init__.py"),
    ("encode", "codec.py"),
    ("decode", "codec.py"),
    ("digest_tensors", "tensors.py"),
    ("publish_raw", "broker.py"),
    ("__init__", "message.py"),
    ("_dispatch", "broker.py"),
    ("on_result", "requests.py"),
    ("accept", "requests.py"),
    ("resolve", "resolve.py"),
    ("run_stage", "program.py"),
    ("run", "program.py"),
    ("to_thread", "threads.py"),
    ("write", "selector_events.py"),
    ("select", "selectors.py"),
)
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^():]+)(?::\d+)?\)$")


def parse_collapsed(text: str) -> tuple[int, Counter[tuple[str, str]], Counter[str]]:
    """(samples, inclusive counts per (function, file name), leaf counts) of py-spy raw output."""
    total = 0
    inclusive: Counter[tuple[str, str]] = Counter()
    leaves: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame(f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += count
        leaves[f"{frames[-1][0]} ({frames[-1][1]})"] += count
    return total, inclusive, leaves


def _frame(text: str) -> tuple[str, str]:
    match = _FRAME.match(text.strip())
    if not match:
        return text.strip(), ""
    return match.group("func"), Path(match.group("file")).name


def summarize_profile(name: str, text: str, seconds: float, rate: int) -> list[str]:
    total, inclusive, leaves = parse_collapsed(text)
    busy = 100.0 * total / max(seconds * rate, 1)
    lines = [f"== {name}: {total} samples, busy {busy:.0f}% of one core"]
    for func, file in HOT_FRAMES:
        count = sum(v for (f, fl), v in inclusive.items() if f.endswith(func) and fl == file)
        if count:
            lines.append(f"  {100.0 * count / total:5.1f}%  {func} ({file})")
    lines.append("  top leaves:")
    for leaf, count in leaves.most_common(8):
        lines.append(f"  {100.0 * count / total:5.1f}%  {leaf}")
    return lines


def _export(args: argparse.Namespace, repo: Path) -> Body:
    """Export the profiled model into ``repo``; the request body that goes with it."""
    ranks, stages = args.rank_size, args.stage_size
    if args.model == "mlp":
        from shardserve.tools.export.mlp import export_mlp

        export_mlp(
            repo,
            rank_size=ranks,
            stage_size=stages,
            hidden=MLP_HIDDEN,
            ffn=MLP_FFN,
            layers=MLP_LAYERS,
        )
        return make_body(args.body, mlp_input(1, MLP_HIDDEN))
    from shardserve.tools.export.matmul import export_matmul

    export_matmul(repo, rank_size=ranks, stage_size=stages)
    return make_body(args.body, matmul_input())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile")
    parser.add_argument("--body", choices=("json", "binary"), default="json")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument(
        "--model",
        choices=("matmul", "mlp"),
        default="matmul",
        help="matmul (rank 1) or the batching benchmark's MLP (one row per request)",
    )
    parser.add_argument("--max-batch-size", type=int, default=32, help="scheduler batching")
    parser.add_argument("--rank-size", type=int, default=1, help="ranks (TP8: 8)")
    parser.add_argument(
        "--stage-size",
        type=int,
        default=1,
        help="pipeline stages (the 2-stage MLP: 2, with 2 ranks)",
    )
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="shardserve-profile-"))
    body = _export(args, work / "repo")
    (work / "logs").mkdir()
    env = {"SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE": str(args.max_batch_size)}
    with (
        dedicated_vhost() as url,
        running_mesh(work / "repo", url, work / "logs", env=env) as mesh,
    ):
        pids = service_pids(mesh.process.pid)
        spies = {
            name: subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(args.seconds)),
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "--nonblocking",
                    "-o",
                    str(work / f"{name}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in pids.items()
        }
        spec = LoadSpec(args.clients, args.seconds - 1.0, 0.5)
        result = asyncio.run(load_http(mesh.infer_url(args.model), body.data, body.headers, spec))
        for spy in spies.values():
            spy.wait()
    print(f"load (under py-spy): {result.to_json()}")
    for name in spies:
        text = (work / f"{name}.txt").read_text() if (work / f"{name}.txt").exists() else ""
        print("\n".join(summarize_profile(name, text, args.seconds, args.rate)))
    print(f"raw profiles: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
