"""``shardserve export``, ``slice`` and ``pack``: the commands that write model
repositories (per-rank ONNX slices, group.json) and per-host bundles of them."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardserve.cli.common import (
    EXIT_USAGE,
    Handler,
    describe_group,
    positive_int,
    report_or_fail,
    stderr_progress,
)

if TYPE_CHECKING:
    from shardserve.cli.common import Subparsers
    from shardserve.repo.repository import GroupConfig


def _already_exported(out: Path, name: str, version: int) -> bool:
    from shardserve.ops.launch.plan import repository_version_is_valid

    return repository_version_is_valid(out, name, version)


# ---------------------------------------------------------------- export


def _add_common_export_options(parser: argparse.ArgumentParser, default_name: str | None) -> None:
    parser.add_argument("--out", type=Path, required=True, help="model repository folder")
    parser.add_argument("--rank-size", type=positive_int, default=1, help="ranks in the group")
    parser.add_argument("--stage-size", type=positive_int, default=1, help="pipeline stages")
    parser.add_argument("--version", type=positive_int, default=1, help="version folder number")
    parser.add_argument(
        "--name",
        default=default_name,
        help="servable name (hf: the checkpoint folder's name; gguf: the file's)",
    )
    add_quantize_options(parser)
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--overwrite", action="store_true", help="replace an existing <out>/<name>/<version>"
    )
    existing.add_argument(
        "--if-missing",
        action="store_true",
        help="keep a valid <out>/<name>/<version>; export (replacing a damaged one) otherwise",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="list every rank's files and every stage's ops"
    )


def add_quantize_options(parser: argparse.ArgumentParser) -> None:
    """``--quantize`` and its two knobs, the same wherever slices are written."""
    parser.add_argument(
        "--quantize",
        choices=("int8", "int4", "int4-mixed", "fp32"),
        default=None,
        help="weight-only block-wise quantization of every linear layer of each rank's slice "
        "(onnxruntime MatMulNBits; int4-mixed: MLP down projection and LM head at int8); "
        "default: fp32, except export gguf: each weight at the precision its GGUF type maps "
        "to (docs/models.md), fp32 for all with --quantize fp32",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="weights per quantization block along K (a power of two >= 16); default: 128 "
        "at 8 bits, 32 at 4 bits (GGUF's Q4_0), and export gguf keeps a file's own blocks "
        "of the bits asked",
    )
    parser.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 4),
        default=4,
        help="MatMulNBits accuracy_level: 4 quantizes activations to int8 per block (fast, "
        "default); 0 keeps them fp32 (exact against the dequantized weights, slow for int8); "
        "with --quantize, or export gguf",
    )


def quantize_spec(args: argparse.Namespace) -> Any:
    """The QuantizeSpec the options ask for, or None (fp32)."""
    if args.quantize is None:
        return None
    from shardserve.tools.quantize import QuantizeSpec

    return QuantizeSpec(args.quantize, args.block_size, args.accuracy_level)


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
        progress=stderr_progress,
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

    def produce() -> GroupConfig:
        return exporter(args.out, **common, **_quantize_param(args), **params)

    return report_or_fail(command, produce, args.out, args.verbose)


def _quantize_param(args: argparse.Namespace) -> dict[str, Any]:
    """``{"quantize": spec}`` when asked (built here so a bad block size is reported)."""
    return {} if args.quantize is None else {"quantize": quantize_spec(args)}


def _export_matmul(args: argparse.Namespace) -> int:
    from shardserve.tools.export.matmul import export_matmul

    return _export("export matmul", export_matmul, args, strategy=args.strategy)


def _export_mlp(args: argparse.Namespace) -> int:
    from shardserve.tools.export.mlp import export_mlp

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
    from shardserve.tools.export.transformer import export_transformer

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


def _export_hf(args: argparse.Namespace) -> int:
    from shardserve.tools.export.hf import export_hf

    return _export("export hf", functools.partial(export_hf, args.checkpoint), args)


def _export_gguf(args: argparse.Namespace) -> int:
    from shardserve.tools.export.gguf import export_gguf

    exporter = functools.partial(export_gguf, args.gguf_file, accuracy_level=args.accuracy_level)
    return _export("export gguf", exporter, args)


def _default_name(args: argparse.Namespace) -> str:
    """export hf: the checkpoint folder's name; export gguf: the file's, less its quant type."""
    if args.model == "gguf":
        from shardserve.tools.export.gguf import default_name

        return default_name(args.gguf_file)
    return str(args.checkpoint.resolve().name)


def _run_export(args: argparse.Namespace) -> int:
    if args.name is None:
        args.name = _default_name(args)
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
    mlp.add_argument("--hidden", type=positive_int, default=1024)
    mlp.add_argument("--ffn", type=positive_int, default=4096)
    mlp.add_argument("--layers", type=positive_int, default=2)
    mlp.add_argument("--seed", type=int, default=0)
    mlp.add_argument("--weights", type=Path, default=None, help="weights file instead of seed")
    mlp.set_defaults(exporter=_export_mlp)

    tf = models.add_parser("transformer", help="a small decoder-only transformer")
    _add_common_export_options(tf, "transformer")
    tf.add_argument("--layers", type=positive_int, default=2)
    tf.add_argument("--hidden", type=positive_int, default=64)
    tf.add_argument("--heads", type=positive_int, default=4)
    tf.add_argument("--vocab", type=positive_int, default=256)
    tf.add_argument("--max-seq", type=positive_int, default=32)
    tf.add_argument("--seed", type=int, default=0)
    tf.add_argument("--weights", type=Path, default=None, help="weights file instead of seed")
    tf.set_defaults(exporter=_export_transformer)

    hf = models.add_parser(
        "hf",
        help="a Hugging Face decoder checkpoint (GPT-2, Llama, Mistral, Qwen2 safetensors)",
    )
    hf.add_argument("checkpoint", type=Path, help="folder with config.json and *.safetensors")
    _add_common_export_options(hf, default_name=None)
    hf.set_defaults(exporter=_export_hf)

    gguf = models.add_parser(
        "gguf",
        help="a llama.cpp GGUF file (Llama, Mistral, Qwen2; weights dequantized to fp32, "
        "or with --quantize of their precision and block size 32, Q8_0/Q4_0 blocks kept)",
    )
    gguf.add_argument("gguf_file", type=Path, help="the .gguf file")
    _add_common_export_options(gguf, default_name=None)
    gguf.set_defaults(exporter=_export_gguf)

    parser.set_defaults(handler=_run_export)


def _run_slice(args: argparse.Namespace) -> int:
    from shardserve.errors import ExportError, RepositoryError
    from shardserve.tools.slicing import tensor_parallel

    try:
        group, report = tensor_parallel(
            args.model,
            args.out,
            ranks=args.tensor_parallel,
            stages=args.stages,
            cuts=args.cut or None,
            name=args.name,
            version=args.version,
            progress=stderr_progress,
            quantize=quantize_spec(args),
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
    parser.add_argument("--stages", type=positive_int, required=True, help="pipeline stages")
    parser.add_argument(
        "--cut",
        action="append",
        metavar="TENSOR",
        help="cut after this tensor (repeat once per cut; default: balanced)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="R",
        help="ranks per stage (tensor parallel inside each stage)",
    )
    parser.add_argument("--out", type=Path, required=True, help="model repository folder")
    parser.add_argument("--name", default=None, help="servable name (default: model file stem)")
    parser.add_argument("--version", type=positive_int, default=1)
    add_quantize_options(parser)
    parser.set_defaults(handler=_run_slice)


def _run_pack(args: argparse.Namespace) -> int:
    from shardserve.errors import RepositoryError
    from shardserve.repo.pack import describe_packed, pack_bundle, parse_ranks

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
    parser.add_argument("--version", type=positive_int, default=None, help="default: all")
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    parser.set_defaults(handler=_run_pack)
