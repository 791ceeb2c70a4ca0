"""``python -m benchmarks [--quick] [--only NAME ...] [--json PATH]`` from the repo root.

Runs the scenarios in order on one dedicated RabbitMQ vhost (deleted at the end), prints
each measurement as it lands, then the table and the ratios, and writes the JSON (default
``benchmarks/results/<commit>.json``). ``--quick`` shortens every load (1 s warm-up + 3 s
measured instead of 2 s + 10 s) and skips the 1-client points of TP8 and PP16.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.meshes import dedicated_vhost
from benchmarks.report import compute_ratios, git_commit, render, write_json
from benchmarks.scenarios import SCENARIOS, Run

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="shardserve performance: mesh vs floor server vs raw broker, as ratios.",
    )
    parser.add_argument("--quick", action="store_true", help="short loads (~10 min in all)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(SCENARIOS),
        metavar="NAME",
        help=f"run only these scenarios ({', '.join(SCENARIOS)})",
    )
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = args.only or list(SCENARIOS)
    commit = git_commit(ROOT)
    out = args.json or RESULTS / f"{commit}{'-quick' if args.quick else ''}.json"
    work = Path(tempfile.mkdtemp(prefix="shardserve-bench-"))
    started = time.monotonic()
    failures: dict[str, str] = {}
    with dedicated_vhost() as amqp_url:
        run = Run(quick=args.quick, amqp_url=amqp_url, work=work)
        for name in names:
            print(f"[{time.monotonic() - started:6.0f} s] {name}", flush=True)
            try:
                SCENARIOS[name](run)
            except Exception as exc:  # one broken scenario must not lose the others
                failures[name] = f"{type(exc).__name__}: {exc}"
                run.notes.append(f"scenario {name} failed: {failures[name][:500]}")
                print(f"  {name} FAILED: {failures[name][:2000]}", flush=True)
    busiest = max(
        (v.get("loadavg_1m", 0.0) for v in run.results.values() if isinstance(v, dict)),
        default=0.0,
    )
    if busiest > (os.cpu_count() or 1):
        run.notes.append(
            f"1-minute load average reached {busiest} on {os.cpu_count()} CPUs: other work "
            "shared the machine; absolute figures (and ratios across scenarios) are unreliable"
        )
    ratios = compute_ratios(run.results)
    print(render(run.results, ratios, run.notes))
    meta = {
        "commit": commit,
        "quick": args.quick,
        "scenarios": names,
        "failed": failures,
        "seconds": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }
    write_json(out, run.results, ratios, meta)
    print(f"\nwrote {out} ({meta['seconds']} s); scratch: {work if args.keep else 'removed'}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
