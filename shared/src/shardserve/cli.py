"""The ``shardserve`` command: export and slice models, run the services, launch a mesh.

Subcommands are registered from ``SUBCOMMANDS`` (name -> builder), so a new one is one
function and one dict entry. The service subcommands (``gateway``, ``scheduler``,
``agent``) replace this process with ``python -m shardserve_<svc> ARGS...``: the CLI never
imports service code, and each service keeps its own parser (``--help`` included).

Exit codes: 0 success; 1 failure at run time; 2 usage, or a model/repository request
that cannot be honoured (the reason is printed on one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from shardserve.repository import GroupConfig

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

SERVICES = ("gateway", "scheduler", "agent")
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------- helpers


def _stderr_progress(line: str) -> None:
    """Exporters report one line per rank; they go to stderr so stdout stays the report."""
    print(line, file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def describe_group(group: GroupConfig) -> str:
    """A human report of one exported/sliced version: stages, programs, rank checksums."""
    lines = [
        f"{group.servable} v{group.version}: {group.rank_size} ranks, {group.stage_size} "
        f"stage(s), {group.ranks_per_stage} rank(s) per stage",
        "  inputs:  " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.inputs),
        "  outputs: " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.outputs),
    ]
    for stage in group.stages:
        ops = " -> ".join(
            op.file if op.op == "run" else f"{op.op}({op.input})" for op in stage.program
        )
        ranks = ",".join(str(r) for r in stage.ranks)
        lines.append(f"  stage {stage.index} ranks [{ranks}]: {ops}")
    for rank in group.ranks:
        files = ", ".join(sorted(rank.files))
        lines.append(f"  rank {rank.rank} (stage {rank.stage}) {rank.checksum[:12]}  {files}")
    return "\n".join(lines)


def _report_or_fail(command: str, produce: Callable[[], GroupConfig]) -> int:
    """Run an export/slice; known failures become one line on stderr and exit 2."""
    from shardserve.errors import ExportError, RepositoryError

    try:
        group = produce()
    except (ExportError, RepositoryError) as exc:
        print(f"shardserve {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(describe_group(group))
    return 0


def _already_exported(out: Path, name: str, version: int) -> bool:
    from shardserve.launcher import repository_version_is_valid

    return repository_version_is_valid(out, name, version)


# ---------------------------------------------------------------- export


def _add_common_export_options(parser: argparse.ArgumentParser, default_name: str) -> None:
    parser.add_argument("--out", type=Path, required=True, help="model repository folder")
    parser.add_argument("--rank-size", type=_positive_int, default=1, help="ranks in the group")
    parser.add_argument("--stage-size", type=_positive_int, default=1, help="pipeline stages")
    parser.add_argument("--version", type=_positive_int, default=1, help="version folder number")
    parser.add_argument("--name", default=default_name, help="servable name")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--overwrite", action="store_true", help="replace an existing <out>/<name>/<version>"
    )
    existing.add_argument(
        "--if-missing",
        action="store_true",
        help="keep a valid <out>/<name>/<version>; export (replacing a damaged one) otherwise",
    )


def _export(
    command: str, exporter: Callable[..., GroupConfig], args: argparse.Namespace, **params: Any
) -> int:
    """Call an exporter with the common options plus ``params``; report or fail cleanly."""
    import inspect

    common: dict[str, Any] = dict(
        rank_size=args.rank_size,
        stage_size=args.stage_size,
        version=args.version,
        name=args.name,
        progress=_stderr_progress,
    )
    if args.overwrite:
        if "overwrite" not in inspect.signature(exporter).parameters:
            target = args.out / args.name / str(args.version)
            print(
                f"shardserve {command}: error: this exporter cannot overwrite; remove "
                f"{target} first",
                file=sys.stderr,
            )
            return EXIT_USAGE
        common["overwrite"] = True
    return _report_or_fail(command, lambda: exporter(args.out, **common, **params))


def _export_matmul(args: argparse.Namespace) -> int:
    from shardserve.export.matmul import export_matmul

    return _export("export matmul", export_matmul, args, strategy=args.strategy)


def _export_mlp(args: argparse.Namespace) -> int:
    from shardserve.export.mlp import export_mlp

    return _export(
        "export mlp",
        export_mlp,
        args,
        hidden=args.hidden,
        ffn=args.ffn,
        layers=args.layers,
        seed=args.seed,
        weights=args.weights,
    )


def _export_transformer(args: argparse.Namespace) -> int:
    from shardserve.export.transformer import export_transformer

    return _export(
        "export transformer",
        export_transformer,
        args,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        max_seq=args.max_seq,
        seed=args.seed,
        weights=args.weights,
    )


def _run_export(args: argparse.Namespace) -> int:
    if args.if_missing:
        if _already_exported(args.out, args.name, args.version):
            print(f"{args.out / args.name / str(args.version)} already holds a valid export; kept")
            return 0
        # Whatever is there is incomplete or damaged: replace it.
        args = argparse.Namespace(**{**vars(args), "overwrite": True})
    exporter: Handler = args.exporter
    return exporter(args)


def build_export(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("export", help="export a demo model as per-rank ONNX slices")
    models = parser.add_subparsers(dest="model", required=True, metavar="MODEL")

    matmul = models.add_parser("matmul", help="x[128,96] @ 0.5 -> Neg (the demo model)")
    _add_common_export_options(matmul, "matmul")
    matmul.add_argument(
        "--strategy",
        choices=("column", "row"),
        default="column",
        help="column: split the weight's columns + allgather; row: rows + allreduce",
    )
    matmul.set_defaults(exporter=_export_matmul)

    mlp = models.add_parser("mlp", help="a tensor-parallel MLP (column then row split)")
    _add_common_export_options(mlp, "mlp")
    mlp.add_argument("--hidden", type=_positive_int, default=1024)
    mlp.add_argument("--ffn", type=_positive_int, default=4096)
    mlp.add_argument("--layers", type=_positive_int, default=2)
    mlp.add_argument("--seed", type=int, default=0)
    mlp.add_argument("--weights", type=Path, default=None, help="weights file instead of seed")
    mlp.set_defaults(exporter=_export_mlp)

    tf = models.add_parser("transformer", help="a small decoder-only transformer")
    _add_common_export_options(tf, "transformer")
    tf.add_argument("--layers", type=_positive_int, default=2)
    tf.add_argument("--hidden", type=_positive_int, default=64)
    tf.add_argument("--heads", type=_positive_int, default=4)
    tf.add_argument("--vocab", type=_positive_int, default=256)
    tf.add_argument("--max-seq", type=_positive_int, default=32)
    tf.add_argument("--seed", type=int, default=0)
    tf.add_argument("--weights", type=Path, default=None, help="weights file instead of seed")
    tf.set_defaults(exporter=_export_transformer)

    parser.set_defaults(handler=_run_export)


# ---------------------------------------------------------------- slice


def _run_slice(args: argparse.Namespace) -> int:
    from shardserve.errors import ExportError, RepositoryError
    from shardserve.slicing import tensor_parallel

    try:
        group, report = tensor_parallel(
            args.model,
            args.out,
            ranks=args.tensor_parallel,
            stages=args.stages,
            cuts=args.cut or None,
            name=args.name,
            version=args.version,
            progress=_stderr_progress,
        )
    except (ExportError, RepositoryError) as exc:
        print(f"shardserve slice: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(describe_group(group))
    for line in report:
        print(f"  {line}")
    return 0


def build_slice(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("slice", help="cut an ONNX model into pipeline stages")
    parser.add_argument("model", type=Path, metavar="MODEL.onnx")
    parser.add_argument("--stages", type=_positive_int, required=True, help="pipeline stages")
    parser.add_argument(
        "--cut",
        action="append",
        metavar="TENSOR",
        help="cut after this tensor (repeat once per cut; default: balanced)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=_positive_int,
        default=1,
        metavar="R",
        help="ranks per stage (tensor parallel inside each stage)",
    )
    parser.add_argument("--out", type=Path, required=True, help="model repository folder")
    parser.add_argument("--name", default=None, help="servable name (default: model file stem)")
    parser.add_argument("--version", type=_positive_int, default=1)
    parser.set_defaults(handler=_run_slice)


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


# ---------------------------------------------------------------- up / status


def _run_up(args: argparse.Namespace) -> int:
    from shardserve.launcher import UpOptions, run_up

    options = UpOptions(
        repository=args.repository,
        host=args.host,
        http_port=args.http_port,
        wait_agents_seconds=args.wait_agents_seconds,
        threads=args.threads,
        no_cache=args.no_cache,
        grace_seconds=args.grace_seconds,
        schedulers=args.schedulers,
    )
    return run_up(options)


def build_up(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "up", help="run scheduler, gateway and one agent per rank of a repository, supervised"
    )
    parser.add_argument(
        "repository",
        type=Path,
        nargs="?",
        default=None,
        metavar="REPO",
        help="model repository (default: the matmul demo, exported on first use)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument("--wait-agents-seconds", type=float, default=0.0)
    parser.add_argument("--threads", type=_positive_int, default=1, help="onnxruntime threads")
    parser.add_argument("--no-cache", action="store_true", help="agents skip the session cache")
    parser.add_argument(
        "--schedulers",
        type=_positive_int,
        default=1,
        help="scheduler processes: one active, the others standby, taking over when it dies",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=15.0,
        help="per tier on stop: wait this long after SIGTERM, then SIGKILL",
    )
    parser.set_defaults(handler=_run_up)


def _run_status(args: argparse.Namespace) -> int:
    from shardserve.launcher import StatusUnavailable, fetch_status, format_status

    try:
        status = fetch_status(args.url, timeout=args.timeout)
    except StatusUnavailable as exc:
        print(f"shardserve status: {exc}", file=sys.stderr)
        return 1
    print(format_status(status))
    return 0


def build_status(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("status", help="show every servable's rank x stage grid")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.set_defaults(handler=_run_status)


def _build_chaos(subparsers: Subparsers) -> None:
    from shardserve.chaos import build_chaos

    build_chaos(subparsers)


def _build_run_rank(subparsers: Subparsers) -> None:
    from shardserve.runrank import build_run_rank

    build_run_rank(subparsers)


def _build_warmup(subparsers: Subparsers) -> None:
    from shardserve.warmup import build_warmup

    build_warmup(subparsers)


# ---------------------------------------------------------------- entry point


def _run_pack(args: argparse.Namespace) -> int:
    from shardserve.errors import RepositoryError
    from shardserve.pack import describe_packed, pack_bundle, parse_ranks

    try:
        ranks = parse_ranks(args.ranks)
        packed = pack_bundle(
            args.repository,
            ranks,
            args.out,
            servable=args.servable,
            version=args.version,
            overwrite=args.overwrite,
        )
    except RepositoryError as exc:
        print(f"shardserve pack: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(describe_packed(packed, args.out))
    return 0


def build_pack(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "pack", help="write a per-host bundle holding only the slices of some ranks"
    )
    parser.add_argument("repository", type=Path, metavar="REPO", help="model repository")
    parser.add_argument("--ranks", required=True, help="ranks to include, e.g. 0-3 or 0,2,5-7")
    parser.add_argument("--servable", default=None, help="only this servable (default: all)")
    parser.add_argument("--version", type=_positive_int, default=None, help="default: all")
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    parser.set_defaults(handler=_run_pack)


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
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
