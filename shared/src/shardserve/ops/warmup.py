"""``shardserve warmup``: build every rank's compile cache ahead of time.

For each servable, version and rank of a repository, open the rank's segments through
``shardserve.runtime.compile_cache`` exactly as an agent (or ``run-rank``) would, so the entries
carry the same keys and a shipped cache is a hit at start. Folders: ``--cache-dir DIR``
puts every rank's entries in DIR (give the agents the same ``--cache-dir``, or the same
``[cache] dir`` to run-rank); without it each rank gets the agent's default folder
``$XDG_CACHE_HOME/shardserve/<servable>/<version>/rank_<r>``. The key includes the
onnxruntime version, the CPU's features, the thread count, the mode and the weights a
rank's segments share (``shardserve.runtime.segments``, the agent's rule): warm up on the machine
type (and with the ``--threads`` and ``--share-weights``) the agents will use.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shardserve.errors import RepositoryError
from shardserve.process.settings import threads_count

if TYPE_CHECKING:
    from shardserve.repo.repository import GroupConfig
    from shardserve.runtime.compile_cache import CacheMode, SessionConfig

# onnxruntime and pydantic are imported when the command runs, so building the
# ``shardserve`` parser stays fast.
MODES = (
    "standard",
    "mem_opt",
)  # shardserve.runtime.compile_cache.CACHE_MODES (a test keeps them equal)

EXIT_FAILED = 1
EXIT_USAGE = 2


@dataclass(frozen=True)
class RankWarmup:
    """The outcome for one rank: hit (already cached), miss (built now) or off (not cached)."""

    servable: str
    version: int
    rank: int
    status: Literal["hit", "miss", "off"]
    ms: float
    folder: Path | None

    def line(self) -> str:
        where = self.folder if self.folder is not None else "(cache folder unusable)"
        return (
            f"{self.servable} v{self.version} rank {self.rank}: {self.status:<4} "
            f"{self.ms:8.1f} ms  {where}"
        )


def warm_rank(
    repo: Path,
    group: GroupConfig,
    rank: int,
    folder: Path,
    config: SessionConfig,
    share_weights: bool = True,
) -> RankWarmup:
    """Open (and so cache) one rank's segments as the agent does (same identities, same
    shared weights, so the same keys); the sessions are dropped right after."""
    from shardserve.runtime.compile_cache import CompileCache
    from shardserve.runtime.segments import (
        SharedWeights,
        find_shared_weights,
        open_segments,
        rank_segments,
    )

    segments = rank_segments(repo, group, rank)
    cache = CompileCache(folder, rank, config)
    started = time.perf_counter()
    paths = {name: segment.path for name, segment in segments.items()}
    shared = find_shared_weights(paths) if share_weights else SharedWeights()
    status = open_segments(cache, segments, shared)[1]
    ms = (time.perf_counter() - started) * 1000
    return RankWarmup(group.servable, group.version, rank, status, ms, cache.folder)


def groups_of(repo: Path, servable: str | None, version: int | None) -> Iterator[GroupConfig]:
    """Every version's group config of the repository (or of one servable / version)."""
    from shardserve.repo.repository import list_servables, list_versions, load_group

    names = [servable] if servable is not None else list_servables(repo)
    for name in names:
        versions = [version] if version is not None else list_versions(repo, name)
        if not versions:
            raise RepositoryError(f"servable {name!r} has no version in repository {repo}")
        for number in versions:
            yield load_group(repo, name, number)


def warmup(
    repo: Path,
    *,
    cache_dir: Path | None = None,
    mode: CacheMode = "standard",
    threads: int = 1,
    servable: str | None = None,
    version: int | None = None,
    share_weights: bool = True,
    report: Callable[[RankWarmup], None] = lambda _: None,
) -> list[RankWarmup]:
    """Warm every selected rank, reporting each as it is done."""
    from shardserve.runtime.compile_cache import SessionConfig, default_cache_dir

    config = SessionConfig(intra_op_threads=threads, inter_op_threads=1, mode=mode)
    results: list[RankWarmup] = []
    for group in groups_of(repo, servable, version):
        for rank in range(group.rank_size):
            folder = cache_dir or default_cache_dir(group.servable, group.version, rank)
            results.append(warm_rank(repo, group, rank, folder, config, share_weights))
            report(results[-1])
    return results


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repository", type=Path, metavar="REPO", help="model repository")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="one folder for every rank (default: each rank's agent default folder)",
    )
    parser.add_argument("--mode", choices=MODES, default="standard")
    parser.add_argument(
        "--threads",
        type=threads_count,
        default=None,
        help="onnxruntime threads, as 'shardserve up --threads' gives each agent of this "
        "repository on this machine (default auto: an even share of the cores; a count "
        "above that share is lowered to it, as 'up' does)",
    )
    parser.add_argument(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as the agents' --share-weights (it changes the cache key of ranks whose "
        "segments share a weight)",
    )
    parser.add_argument("--servable", default=None, help="only this servable")
    parser.add_argument("--version", type=int, default=None, help="only this version")


def up_threads(repo: Path, requested: int | None = None) -> int:
    """The thread count ``shardserve up [--threads requested]`` gives each agent of
    ``repo`` here: its own rule (``with_agent_threads``) over the versions it would find
    at start."""
    from shardserve.ops.launch.plan import UpOptions, discover_groups, with_agent_threads

    agents = sum(group.rank_size for group in discover_groups(repo))
    options, _ = with_agent_threads(UpOptions(threads=requested), agents)
    assert options.threads is not None
    return options.threads


def run_warmup(args: argparse.Namespace) -> int:
    try:
        threads = up_threads(args.repository, args.threads)
        print(f"onnxruntime threads: {threads}", flush=True)
        results = warmup(
            args.repository,
            cache_dir=args.cache_dir,
            mode=args.mode,
            threads=threads,
            servable=args.servable,
            version=args.version,
            share_weights=args.share_weights,
            report=lambda r: print(r.line(), flush=True),
        )
    except RepositoryError as exc:
        print(f"shardserve warmup: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    built = sum(1 for r in results if r.status == "miss")
    hits = sum(1 for r in results if r.status == "hit")
    unusable = sum(1 for r in results if r.status == "off")
    print(f"{len(results)} rank(s): {built} built, {hits} already cached, {unusable} uncached")
    return EXIT_FAILED if unusable else 0


def build_warmup(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``warmup`` subcommand (registered in ``shardserve.cli.SUBCOMMANDS``)."""
    parser = subparsers.add_parser(
        "warmup", help="build every rank's compile cache ahead of time (per rank: hit/miss, time)"
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_warmup)
