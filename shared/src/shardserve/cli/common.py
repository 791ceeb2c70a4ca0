"""What the ``shardserve`` subcommands share: exit codes, argument types, reports."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

# The subcommands' argument type is the services' one (re-exported for cli.models/cli.serve).
from shardserve.process.settings import positive_int as positive_int

if TYPE_CHECKING:
    from shardserve.repo.repository import GroupConfig, ProgramOp, RankSpec, StageSpec

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]


def stderr_progress(line: str) -> None:
    """Exporters report one line per rank; they go to stderr so stdout stays the report."""
    print(line, file=sys.stderr, flush=True)


SHORT_PROGRAM = 12  # ops: a longer stage program is shown as counts unless verbose


def describe_group(group: GroupConfig, folder: Path | None = None, verbose: bool = True) -> str:
    """A human report of one exported/sliced version: stages, programs, and per rank its
    file count, bytes (when ``folder``, the version's folder, is given) and checksum. Not
    ``verbose``: a long program as op counts, no file names (an HF model has ~90 per rank)."""
    lines = [
        f"{group.servable} v{group.version}: {group.rank_size} ranks, {group.stage_size} "
        f"stage(s), {group.ranks_per_stage} rank(s) per stage",
        "  inputs:  " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.inputs),
        "  outputs: " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.outputs),
    ]
    for stage in group.stages:
        ranks = ",".join(str(r) for r in stage.ranks)
        lines.append(f"  stage {stage.index} ranks [{ranks}]: {_describe_program(stage, verbose)}")
    for rank in group.ranks:
        size = "" if folder is None else f", {_rank_bytes(folder / f'rank_{rank.rank}', rank)}"
        line = f"  rank {rank.rank} (stage {rank.stage}): {len(rank.files)} files{size}"
        line += f", checksum {rank.checksum[:12]}"
        lines.append(line + (f"  {', '.join(sorted(rank.files))}" if verbose else ""))
    return "\n".join(lines)


def _describe_program(stage: StageSpec, verbose: bool) -> str:
    if verbose or len(stage.program) <= SHORT_PROGRAM:
        return " -> ".join(_describe_op(op) for op in stage.program)
    counts = Counter(op.op for op in stage.program)
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) + " (--verbose: the ops)"


def _rank_bytes(folder: Path, rank: RankSpec) -> str:
    total = sum((folder / name).stat().st_size for name in rank.files if (folder / name).is_file())
    return f"{total:,} bytes"


def _describe_op(op: ProgramOp) -> str:
    if op.op == "run":
        return op.file
    if op.op == "attention":
        return f"attention(layer {op.layer})"
    return f"{op.op}({op.input})"


def report_or_fail(
    command: str,
    produce: Callable[[], GroupConfig],
    out: Path | None = None,
    verbose: bool = True,
) -> int:
    """Run an export/slice; known failures become one line on stderr and exit 2. ``out``:
    the repository, to report each rank's bytes from its folder."""
    from shardserve.errors import ExportError, RepositoryError

    try:
        group = produce()
    except (ExportError, RepositoryError) as exc:
        print(f"shardserve {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    folder = None if out is None else out / group.servable / str(group.version)
    print(describe_group(group, folder, verbose))
    return 0
