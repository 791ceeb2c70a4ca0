"""``python -m benchmarks [--quick] [--only NAME ...] [--rounds N] [--gateways N]
[--json PATH]`` from the repo root.

Runs the scenarios in order on one dedicated RabbitMQ vhost (deleted at the end), prints
each measurement as it lands, then the table and the ratios, and writes the JSON (default
``benchmarks/results/<commit>.json``). ``--quick`` shortens every load (1 s warm-up + 3 s
measured instead of 2 s + 10 s) and skips the 1-client points of TP8 and PP16.
``--rounds N`` runs them all N times and reports medians (``benchmarks.rounds``); every
mesh runs ``--gateways`` gateway processes on its port (default 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.meshes import dedicated_vhost
from benchmarks.report import git_commit, render, write_json
from benchmarks.rounds import combine_ratios, combine_results
from benchmarks.run import Run
from benchmarks.scenarios import SCENARIOS
from shardserve.process.heap import keep_freed_memory

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_GATEWAYS = 2


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
    parser.add_argument(
        "--gateways",
        type=int,
        default=DEFAULT_GATEWAYS,
        help=f"gateway processes per mesh, sharing its port (default {DEFAULT_GATEWAYS})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the scenarios this many times; report each ratio's median round "
        "(benchmarks.rounds)",
    )
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.gateways < 1:
        parser.error("--rounds and --gateways must be at least 1")
    names = args.only or list(SCENARIOS)
    # This process is the raw hop's requester (and every load's client): it gets the C heap
    # tuning the services and the floor run with, like the responder.
    keep_freed_memory()
    commit = git_commit(ROOT)
    out = args.json or RESULTS / f"{commit}{'-quick' if args.quick else ''}.json"
    work = Path(tempfile.mkdtemp(prefix="shardserve-bench-"))
    started = time.monotonic()
    failures: dict[str, str] = {}
    with dedicated_vhost() as amqp_url:
        run = Run(quick=args.quick, amqp_url=amqp_url, work=work, gateways=args.gateways)
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            if args.rounds > 1:
                print(f"[{time.monotonic() - started:6.0f} s] round {index + 1}", flush=True)
            run.results = {}
            _run_scenarios(run, names, started, failures)
            rounds.append(run.results)
    _note_busy_machine(run, rounds)
    results = combine_results(rounds)
    ratios = combine_ratios(rounds)
    print(render(results, ratios, run.notes))
    meta = {
        "commit": commit,
        "quick": args.quick,
        "gateways": args.gateways,
        "rounds": args.rounds,
        "scenarios": names,
        "failed": failures,
        "seconds": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }
    write_json(out, results, ratios, meta, rounds if args.rounds > 1 else None)
    print(f"\nwrote {out} ({meta['seconds']} s); scratch: {work if args.keep else 'removed'}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def _run_scenarios(run: Run, names: list[str], started: float, failures: dict[str, str]) -> None:
    for name in names:
        print(f"[{time.monotonic() - started:6.0f} s] {name}", flush=True)
        try:
            SCENARIOS[name](run)
        except Exception as exc:  # one broken scenario must not lose the others
            failures[name] = f"{type(exc).__name__}: {exc}"
            run.notes.append(f"scenario {name} failed: {failures[name][:500]}")
            print(f"  {name} FAILED: {failures[name][:2000]}", flush=True)


def _note_busy_machine(run: Run, rounds: list[dict[str, Any]]) -> None:
    busiest = max(
        (
            v.get("loadavg_1m", 0.0)
            for results in rounds
            for v in results.values()
            if isinstance(v, dict)
        ),
        default=0.0,
    )
    if busiest > (os.cpu_count() or 1):
        run.notes.append(
            f"1-minute load average reached {busiest} on {os.cpu_count()} CPUs: other work "
            "shared the machine; absolute figures (and ratios across scenarios) are unreliable"
        )


if __name__ == "__main__":
    sys.exit(main())
