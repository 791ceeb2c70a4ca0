"""Agent settings: the command line, with defaults from ``SHARDSERVE_AGENT_*`` variables.

Read once in ``__main__``; everything else receives the frozen ``AgentSettings``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.process.cores import usable_cores
from shardserve.process.settings import (
    BrokerSettings,
    env_default,
    env_flag,
    non_negative_int,
    positive_float,
    positive_int,
    threads_count,
)
from shardserve.runtime.compile_cache import CACHE_MODES, CacheMode

ENV_PREFIX = "SHARDSERVE_AGENT_"

MEMORY_HELP = (
    "cap the agent's address space (RLIMIT_AS) at N MiB before loading its slice; a slice "
    "that does not fit ends the agent with exit code 1 and a message saying so. RLIMIT_AS "
    "counts virtual memory, not RSS: measured on x86-64 Linux (Python 3.11, onnxruntime "
    "1.32, --threads 1), a minimal agent with a tiny slice needs 200-300 MiB of address "
    "space before serving, and each extra thread reserves stack and malloc-arena space; "
    "allow at least 400 MiB plus about 3x the slice's size on disk."
)
CACHE_DIR_HELP = (
    "folder of this rank's compile cache (optimized ONNX graphs). Default: "
    "$XDG_CACHE_HOME/shardserve/<servable>/<version>/rank_<rank> (XDG_CACHE_HOME defaults "
    "to ~/.cache), so the model repository can stay read-only. An unwritable folder only "
    "disables the cache, with a warning."
)
CACHE_MODE_HELP = (
    "standard (default) or mem_opt (MindSpore Lite's model_cache_mode=mem_opt): lower "
    "memory; the cached graph keeps its weights in a page-aligned data file that "
    "onnxruntime maps into memory and runs from directly (weight prepacking off, no memory "
    "arena), so the weights are clean file pages instead of a private copy. A missing "
    "artefact falls back to the regular load (logged) and is written for the next start. "
    "See shardserve.runtime.compile_cache."
)
SHARE_WEIGHTS_HELP = (
    "hold one copy of a weight that several of this rank's segments contain (same name, "
    "same bytes) and hand it to every session that uses it (default on). Those sessions "
    "run with weight prepacking off: a packed copy per session would undo the saving."
)


@dataclass(frozen=True)
class AgentSettings:
    """Everything an agent needs to know, decided once at start."""

    repository: Path
    servable: str
    rank: int
    version: int | None = None  # None: the highest version in the repository
    threads: int = 1
    cache_dir: Path | None = None  # None: the default folder (see CACHE_DIR_HELP)
    use_cache: bool = True
    cache_mode: CacheMode = "standard"
    share_weights: bool = True
    max_memory_mb: int | None = None
    heartbeat_interval: float = 1.0
    drain_seconds: float = 10.0
    broker: BrokerSettings = field(default_factory=BrokerSettings)

    def default_cache_dir(self, version: int, environ: Mapping[str, str] | None = None) -> Path:
        env = os.environ if environ is None else environ
        base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return base / "shardserve" / self.servable / str(version) / f"rank_{self.rank}"

    def resolved_cache_dir(self, version: int) -> Path | None:
        """The compile cache folder, or None when the cache is off."""
        if not self.use_cache:
            return None
        return self.cache_dir or self.default_cache_dir(version)


def _cache_mode(text: str) -> CacheMode:
    for mode in CACHE_MODES:
        if text == mode:
            return mode
    raise ValueError(f"unknown cache mode {text!r}")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The agent's command line; every option defaults from SHARDSERVE_AGENT_<OPTION>."""
    env = os.environ if environ is None else environ

    def default(name: str) -> str | None:
        return env_default(env, ENV_PREFIX, name)

    parser = argparse.ArgumentParser(
        prog="shardserve_agent",
        description="Serve one rank of a servable: load its ONNX slice, run stage work, "
        "exchange collectives with the stage's other ranks over RabbitMQ.",
    )
    add = parser.add_argument
    repo_default, servable_default, rank_default = (
        default("REPOSITORY"),
        default("SERVABLE"),
        default("RANK"),
    )
    add(
        "--repository",
        type=Path,
        default=repo_default,
        required=repo_default is None,
        help="model repository folder",
    )
    add(
        "--servable",
        default=servable_default,
        required=servable_default is None,
        help="servable name (a folder of the repository)",
    )
    add(
        "--version",
        type=positive_int,
        default=default("VERSION"),
        help="servable version (default: the highest in the repository)",
    )
    add(
        "--rank",
        type=non_negative_int,
        default=rank_default,
        required=rank_default is None,
        help="the rank this agent serves",
    )
    add(
        "--threads",
        type=threads_count,
        default=default("THREADS") or "1",
        help="onnxruntime intra-op threads per session (default 1; auto: every core this "
        "process may use, its affinity capped by its cgroup CPU quota, e.g. one agent per "
        "container with a CPU limit)",
    )
    add("--cache-dir", type=Path, default=default("CACHE_DIR"), help=CACHE_DIR_HELP)
    add(
        "--no-cache",
        dest="use_cache",
        action="store_false",
        default=env_flag(env, ENV_PREFIX, "CACHE", True),
        help="do not use the compile cache",
    )
    add(
        "--cache-mode",
        choices=CACHE_MODES,
        default=default("CACHE_MODE") or "standard",
        help=CACHE_MODE_HELP,
    )
    add(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        default=env_flag(env, ENV_PREFIX, "SHARE_WEIGHTS", True),
        help=SHARE_WEIGHTS_HELP,
    )
    add("--max-memory-mb", type=positive_int, default=default("MAX_MEMORY_MB"), help=MEMORY_HELP)
    add(
        "--heartbeat-interval",
        type=positive_float,
        default=default("HEARTBEAT_INTERVAL") or 1.0,
        help="seconds between heartbeats",
    )
    add(
        "--drain-seconds",
        type=float,
        default=default("DRAIN_SECONDS") or 10.0,
        help="on SIGTERM, how long the job in flight may take to finish (default 10)",
    )
    return parser


def parse_settings(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentSettings:
    """Parse the command line (exits with code 2 on a usage error)."""
    env = os.environ if environ is None else environ
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.cache_mode not in CACHE_MODES:  # a bad SHARDSERVE_AGENT_CACHE_MODE value
        parser.error(f"--cache-mode must be {'|'.join(CACHE_MODES)}, not {args.cache_mode!r}")
    # argparse applies ``type`` to string defaults, so env values are checked the same way.
    return AgentSettings(
        repository=args.repository,
        servable=args.servable,
        rank=int(args.rank),
        version=None if args.version is None else int(args.version),
        threads=args.threads or usable_cores(),
        cache_dir=args.cache_dir,
        use_cache=bool(args.use_cache),
        cache_mode=_cache_mode(args.cache_mode),
        share_weights=bool(args.share_weights),
        max_memory_mb=None if args.max_memory_mb is None else int(args.max_memory_mb),
        heartbeat_interval=float(args.heartbeat_interval),
        drain_seconds=max(0.0, float(args.drain_seconds)),
        broker=BrokerSettings.from_env(dict(env)),
    )
