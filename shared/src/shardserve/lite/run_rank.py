"""``shardserve run-rank``: one rank of a model run standalone, MindSpore Lite style.

No scheduler, no gateway: start one process per rank (see ``examples/run_ranks.sh``),
each loads its slice, compiles it through the compile cache of the ini file, fills the
inputs (ones, or ``--inputs`` .npy files in the model's input order), meets its peers over
RabbitMQ under a shared run id, predicts, and prints for every output its name, data
size in bytes, element count and first 10 elements. Built on ``shardserve.lite``.

Exit codes: 0 success; 1 the run failed (a peer missing or failing, the broker down);
2 usage (bad model path, config file or input files).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from shardserve.errors import ShardserveError

if TYPE_CHECKING:
    from shardserve.lite import Context, Model, Tensor

# Heavy modules (numpy, onnxruntime, pydantic) are imported when the command runs, so
# building the ``shardserve`` parser stays fast.

EXIT_FAILED = 1
EXIT_USAGE = 2
SHOWN_ELEMENTS = 10


class UsageError(Exception):
    """Something the user passed cannot be used (exit 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="SLICE",
        help="a version folder (models/matmul/1; needs --rank) or a rank folder "
        "(models/matmul/1/rank_0)",
    )
    parser.add_argument("--rank", type=int, default=None, help="this process's rank")
    parser.add_argument(
        "--config", type=Path, default=None, metavar="INI", help="config file ([cache] dir, mode)"
    )
    parser.add_argument(
        "--inputs",
        type=Path,
        nargs="+",
        default=None,
        metavar="NPY",
        help="one .npy file per model input, in input order (default: all ones)",
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help="shared by every rank of one run (default: $SHARDSERVE_RUN_ID, else "
        "<servable>-v<version>); give concurrent runs of one model distinct ids",
    )
    parser.add_argument(
        "--amqp-url", default=None, help="broker URL (default: $SHARDSERVE_AMQP_URL)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for every peer to start, and for each predict (default: 60)",
    )


def run_rank(args: argparse.Namespace) -> int:
    """The subcommand: build, predict once, print the outputs."""
    from shardserve.errors import RepositoryError
    from shardserve.lite import Context, LiteError, Model, PeerFailedError, RendezvousError
    from shardserve.process.lifecycle import setup_logging

    setup_logging("run-rank", "WARNING")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    context = Context(rank_id=args.rank, run_id=args.run_id, amqp_url=args.amqp_url)
    if args.timeout is not None:
        context.timeout_s = args.timeout
    try:
        with Model() as model:
            report = _build_and_predict(model, args, context)
    except (RendezvousError, PeerFailedError) as exc:
        print(f"shardserve run-rank: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (UsageError, LiteError, RepositoryError) as exc:
        print(f"shardserve run-rank: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ShardserveError, OSError) as exc:
        print(f"shardserve run-rank: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(report, flush=True)  # one write, so concurrent ranks do not interleave lines
    return 0


def _build_and_predict(model: Model, args: argparse.Namespace, context: Context) -> str:
    started = time.perf_counter()
    model.build_from_file(args.model, context, args.config)
    build_ms = (time.perf_counter() - started) * 1000
    inputs = model.get_inputs()
    _fill(inputs, args.inputs)
    started = time.perf_counter()
    outputs = model.predict(inputs)
    predict_ms = (time.perf_counter() - started) * 1000
    return format_report(model, outputs, build_ms, predict_ms)


def _fill(inputs: list[Tensor], files: list[Path] | None) -> None:
    import numpy as np

    from shardserve.lite import LiteError

    if files is None:
        for tensor in inputs:
            tensor.fill_ones()
        return
    if len(files) != len(inputs):
        names = ", ".join(t.name for t in inputs)
        raise UsageError(
            f"the model has {len(inputs)} input(s) ({names}), got {len(files)} file(s)"
        )
    for tensor, path in zip(inputs, files, strict=True):
        try:
            tensor.set_data_from_numpy(np.load(path, allow_pickle=False))
        except (OSError, ValueError, LiteError) as exc:
            raise UsageError(f"input {tensor.name} from {path}: {exc}") from exc


def format_report(model: Model, outputs: list[Tensor], build_ms: float, predict_ms: float) -> str:
    """MindSpore Lite's example output, one block per rank, prefixed with the rank."""
    group, rank = model.group, model.rank
    tag = f"rank {rank}:"
    lines = [
        f"{tag} {group.servable} v{group.version}, rank {rank} of {group.rank_size}, stage "
        f"{model.stage.index} of {group.stage_size}, run {model.run_id}: compile cache "
        f"{model.cache_status}, build {build_ms:.1f} ms, predict {predict_ms:.1f} ms"
    ]
    for tensor in outputs:
        flat = tensor.get_data_to_numpy().reshape(-1)[:SHOWN_ELEMENTS]
        lines.append(
            f"{tag} tensor name is: {tensor.name} tensor size is: {tensor.data_size} "
            f"tensor elements num is: {tensor.element_num}"
        )
        lines.append(f"{tag} output data is: " + " ".join(str(v) for v in flat.tolist()))
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C: the model leaves the run and closes its connection."""
    raise SystemExit(128 + signum)


def build_run_rank(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``run-rank`` subcommand (registered in ``shardserve.cli.SUBCOMMANDS``)."""
    parser = subparsers.add_parser(
        "run-rank",
        help="run one rank of a model standalone, peers over RabbitMQ (MindSpore Lite style)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_rank)
