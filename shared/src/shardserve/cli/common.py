"""What the ``shardserve`` subcommands share: exit codes, argument types, reports."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

# The subcommands' argument type is the services' one (re-exported for cli.models/cli.serve).
from shardserve.process.settings import positive_int as positive_int

if TYPE_CHECKING:
    from shardserve.repo.repository import GroupConfig, ProgramOp

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]


def stderr_progress(line: str) -> None:
    """Exporters report one line per rank; they go to stderr so stdout stays the report."""
    print(line, file=sys.stderr, flush=True)


def describe_group(group: GroupConfig) -> str:
    """A human report of one exported/sliced version: stages, programs, rank checksums."""
    lines = [
        f"{group.servable} v{group.version}: {group.rank_size} ranks, {group.stage_size} "
        f"stage(s), {group.ranks_per_stage} rank(s) per stage",
        "  inputs:  " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.inputs),
        "  outputs: " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in group.outputs),
    ]
    for stage in group.stages:
        ops = " -> ".join(_describe_op(op) for op in stage.program)
        ranks = ",".join(str(r) for r in stage.ranks)
        lines.append(f"  stage {stage.index} ranks [{ranks}]: {ops}")
    for rank in group.ranks:
        files = ", ".join(sorted(rank.files))
        lines.append(f"  rank {rank.rank} (stage {rank.stage}) {rank.checksum[:12]}  {files}")
    return "\n".join(lines)


def _describe_op(op: ProgramOp) -> str:
    if op.op == "run":
        return op.file
    if op.op == "attention":
        return f"attention(layer {op.layer})"
    return f"{op.op}({op.input})"


def report_or_fail(command: str, produce: Callable[[], GroupConfig]) -> int:
    """Run an export/slice; known failures become one line on stderr and exit 2."""
    from shardserve.errors import ExportError, RepositoryError

    try:
        group = produce()
    except (ExportError, RepositoryError) as exc:
        print(f"shardserve {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(describe_group(group))
    return 0
