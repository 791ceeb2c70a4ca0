"""``shardserve chaos``: start a mesh, run the scenarios under load, print the figures.

Exit code 0 when every scenario passed (hung = lost = duplicated = 0, recovered, no
problem found), 1 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from shardserve.ops.chaos import names as scenario_names

if TYPE_CHECKING:
    from shardserve.ops.chaos.driver import Pace
    from shardserve.ops.chaos.report import ScenarioReport
    from shardserve.ops.chaos.target import ChaosMesh

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_USAGE = 2


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in scenario_names.ALL]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(scenario_names.ALL)}"
        )
    return names


def build_chaos(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "chaos", help="fault-inject a local mesh under load and count every request's outcome"
    )
    parser.add_argument(
        "--scenarios",
        type=_names,
        default=None,
        metavar="A,B",
        help=f"comma-separated, run in this order (known: {', '.join(scenario_names.ALL)})",
    )
    parser.add_argument("--quick", action="store_true", help="short phases; CI's scenario set")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write figures")
    parser.add_argument("--ranks", type=int, default=2, help="matmul ranks of the mesh")
    parser.add_argument("--workdir", type=Path, default=None, help="repository + mesh log")
    parser.set_defaults(handler=run_chaos_command)


def run_chaos_command(args: argparse.Namespace) -> int:
    from shardserve.ops.chaos.driver import FULL, QUICK
    from shardserve.ops.chaos.report import format_report

    scenarios = args.scenarios or list(scenario_names.QUICK if args.quick else scenario_names.ALL)
    pace = QUICK if args.quick else FULL
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardserve-chaos-"))
    reports = run_chaos(scenarios, pace, workdir, ranks=args.ranks)
    for report in reports:
        print(format_report(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures(reports, scenarios, pace), indent=2))
    return 0 if reports and all(r.passed for r in reports) else 1


def figures(
    reports: Sequence[ScenarioReport], scenarios: Sequence[str], pace: Pace
) -> dict[str, Any]:
    return {
        "scenarios": list(scenarios),
        "pace": pace.__dict__,
        "passed": bool(reports) and all(r.passed for r in reports),
        "reports": [r.as_dict() for r in reports],
    }


def run_chaos(
    scenarios: Sequence[str], pace: Pace, workdir: Path, *, ranks: int = 2
) -> list[ScenarioReport]:
    """Start a mesh, run each scenario in order on it, stop it; one report per scenario."""
    from shardserve.ops.chaos.target import ChaosMesh, MeshError

    mesh = ChaosMesh(workdir, ranks=ranks)
    try:
        mesh.start()
        return asyncio.run(_run_all(mesh, scenarios, pace))
    except MeshError as exc:
        print(f"shardserve chaos: {exc}\n{mesh.log_tail()}", file=sys.stderr)
        return []
    finally:
        mesh.stop()
        mesh.cleanup()


async def _run_all(mesh: ChaosMesh, scenarios: Sequence[str], pace: Pace) -> list[ScenarioReport]:
    from shardserve.ops.chaos.driver import READY_WITHIN_S, Context, wait_healthy
    from shardserve.ops.chaos.report import ScenarioReport, format_report
    from shardserve.ops.chaos.scenarios import SCENARIOS

    ctx = Context(mesh, pace)
    reports: list[ScenarioReport] = []
    for name in scenarios:
        if not await wait_healthy(mesh, READY_WITHIN_S if not reports else pace.recover_within_s):
            reports.append(
                ScenarioReport(
                    name, recovered=False, problems=["mesh not ready before the scenario"]
                )
            )
            print(f"{name}: mesh not ready\n{mesh.log_tail()}", file=sys.stderr, flush=True)
            continue
        print(f"--- {name}", file=sys.stderr, flush=True)
        try:
            report = await SCENARIOS[name](ctx)
        except Exception as exc:  # a broken scenario must not hide the others' figures
            report = ScenarioReport(name, recovered=False, problems=[f"scenario crashed: {exc!r}"])
        print(format_report(report), file=sys.stderr, flush=True)
        reports.append(report)
    return reports
