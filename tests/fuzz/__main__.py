"""``scripts/fuzz [--quick] [--http N] [--amqp N] [--grpc N]``: fuzz a local mesh, print
the counts.

Exit code 0 when the run passed (see ``tests.fuzz.run``), 1 when it did not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.fuzz.run import run_fuzz

FULL = (10_000, 10_000, 10_000)
QUICK = (200, 300, 20)  # (the generation part adds about 50 s on a loaded machine)
GRPC_FULL, GRPC_QUICK = 10_000, 300  # gRPC calls (tests/fuzz/grpc_fuzz.py)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/fuzz",
        description="Fuzz every HTTP route and AMQP consumer of a local matmul mesh.",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK[0]} + {QUICK[1]} (CI)")
    parser.add_argument(
        "--http", type=int, default=None, metavar="N", help="HTTP requests (0: none)"
    )
    parser.add_argument(
        "--amqp", type=int, default=None, metavar="N", help="AMQP messages (0: none)"
    )
    parser.add_argument(
        "--generation",
        type=int,
        default=None,
        metavar="N",
        help="requests per generation route and malformed generate/cancel messages (0: none)",
    )
    parser.add_argument(
        "--grpc",
        type=int,
        default=None,
        metavar="N",
        help=f"calls to the gRPC API ({GRPC_FULL:,}; --quick: {GRPC_QUICK}; 0: none)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="matmul ranks of the mesh")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write figures")
    parser.add_argument("--workdir", type=Path, default=None, help="repository + mesh log")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    http, amqp, generation = QUICK if args.quick else FULL
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardserve-fuzz-"))
    http = http if args.http is None else args.http  # (0: that half is left out)
    amqp = amqp if args.amqp is None else args.amqp
    generation = generation if args.generation is None else args.generation
    grpc = (GRPC_QUICK if args.quick else GRPC_FULL) if args.grpc is None else args.grpc
    run = run_fuzz(workdir, http, amqp, args.ranks, generation, grpc)
    print("\n".join(run.lines()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(run.as_dict(), indent=2))
    if not run.passed:
        print(f"mesh log: {workdir / 'mesh.log'}", file=sys.stderr)
    return 0 if run.passed else 1


if __name__ == "__main__":
    sys.exit(main())
