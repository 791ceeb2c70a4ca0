"""The ``shardserve`` command: export and slice models, run the services, launch a mesh.

Subcommands are registered from ``SUBCOMMANDS`` (name -> builder), so a new one is one
function and one dict entry; the builders of each command group live beside this module
(``models``: export, slice, pack; ``serve``: up, status; ``common``: what they share) or next
to the feature (chaos, run-rank, warmup). The service subcommands (``gateway``,
``scheduler``, ``agent``) replace this process with ``python -m shardserve_<svc> ARGS...``:
the CLI never imports service code, and each service keeps its own parser (``--help``
included).

Exit codes: 0 success; 1 failure at run time; 2 usage, or a model/repository request
that cannot be honoured (the reason is printed on one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shardserve.cli.common import EXIT_USAGE, Handler, describe_group
from shardserve.cli.models import build_export, build_pack, build_slice
from shardserve.cli.serve import build_status, build_up

if TYPE_CHECKING:
    from shardserve.cli.common import Subparsers

SERVICES = ("gateway", "scheduler", "agent")

__all__ = ["EXIT_USAGE", "SERVICES", "SUBCOMMANDS", "build_parser", "describe_group", "main"]


# ---------------------------------------------------------------- services


def exec_service(service: str, args: Sequence[str]) -> int:
    """Become ``python -m shardserve_<service> ARGS...`` (same interpreter, same env)."""
    argv = [sys.executable, "-m", f"shardserve_{service}", *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # pragma: no cover - execv does not return


def _service_builder(service: str) -> Callable[[Subparsers], None]:
    """A pass-through subcommand; main() hands it over before parsing, so the service's
    own parser sees every argument (``--help`` included)."""

    def build(subparsers: Subparsers) -> None:
        sub = subparsers.add_parser(
            service, add_help=False, help=f"run the {service} (python -m shardserve_{service})"
        )
        sub.add_argument("args", nargs=argparse.REMAINDER)
        sub.set_defaults(handler=lambda args: exec_service(service, args.args))

    return build


# ---------------------------------------------------------------- lazily built


def _build_chaos(subparsers: Subparsers) -> None:
    from shardserve.ops.chaos import build_chaos

    build_chaos(subparsers)


def _build_run_rank(subparsers: Subparsers) -> None:
    from shardserve.lite.run_rank import build_run_rank

    build_run_rank(subparsers)


def _build_warmup(subparsers: Subparsers) -> None:
    from shardserve.ops.warmup import build_warmup

    build_warmup(subparsers)


# ---------------------------------------------------------------- entry point


SUBCOMMANDS: dict[str, Callable[[Subparsers], None]] = {
    "export": build_export,
    "slice": build_slice,
    "pack": build_pack,
    "up": build_up,
    "status": build_status,
    "run-rank": _build_run_rank,
    "warmup": _build_warmup,
    "chaos": _build_chaos,
    **{service: _service_builder(service) for service in SERVICES},
}


def build_parser() -> argparse.ArgumentParser:
    from shardserve import __version__

    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="Distributed inference serving: per-rank ONNX slices over RabbitMQ.",
    )
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for build in SUBCOMMANDS.values():
        build(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in SERVICES:
        return exec_service(args_list[0], args_list[1:])
    args = build_parser().parse_args(args_list)
    handler: Handler = args.handler
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader left (`shardserve status | head -1`): what it wanted is out; no
        # traceback. Python would still fail flushing stdout at exit: point it at devnull.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
