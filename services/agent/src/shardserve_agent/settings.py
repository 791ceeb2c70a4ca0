"""Agent settings: the command line, with defaults from ``SHARDSERVE_AGENT_*`` variables.

Each option is declared once, on the ``AgentSettings`` field it fills
(``shardserve.process.options``). Read once in ``__main__``; everything else receives the
frozen ``AgentSettings``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.process import options
from shardserve.process.cores import usable_cores
from shardserve.process.options import option
from shardserve.process.settings import (
    BrokerSettings,
    non_negative_int,
    positive_float,
    positive_int,
    threads_count,
)
from shardserve.runtime.compile_cache import CACHE_MODES, CacheMode, default_cache_dir

ENV_PREFIX = "SHARDSERVE_AGENT_"

MEMORY_HELP = (
    "cap the memory the agent can write to at N MiB (RLIMIT_DATA: heap, anonymous maps, "
    "thread stacks; not code, shared libraries or reserved address space), set before its "
    "slice loads. An allocation beyond it fails with an error instead of the OOM killer; a "
    "slice that does not fit ends the agent with exit code 1 and a message saying so. "
    "Measured on x86-64 Linux (Python 3.11, onnxruntime 1.32, --threads 1), allow: the "
    "slice's size on disk + the KV budget + 100 MiB + two thirds of its largest segment "
    "file (at least 25 MiB), plus 2 MiB per segment for each --threads beyond 1 "
    "(docs/operations.md, Memory caps)."
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
FUSED_HELP = (
    "generation servables: compose the segments and attention ops between two collectives "
    "into one onnxruntime model (attention as GroupQueryAttention over the sequence's KV "
    "cache, bound in place), run in one go when a step is one sequence's (default on; "
    "steps that pack several sequences run it one segment at a time, on the same weights). "
    "Off: one session per segment and numpy attention. Not through the compile cache. See "
    "shardserve.runtime.compose."
)
KV_CACHE_HELP = (
    "generation servables: the KV cache budget of this rank in MiB (sequences are admitted "
    "only while their whole length fits). Default: the smallest of 4096 MiB, 60 %% of the "
    "memory available at start minus the slice, and, with --max-memory-mb, half the room "
    "that cap leaves once the slice is loaded. A value above that room is lowered to it."
)

THREADS_HELP = (
    "onnxruntime intra-op threads per session; their workers sleep while they wait (no "
    "spinning), so the sessions of a slice take turns on the same cores. Default auto: "
    "every core this process may use, its affinity capped by its cgroup CPU quota (one "
    "agent per container with a CPU limit); 'shardserve up' passes each agent its share "
    "of the host's cores instead"
)


def _cache_mode(text: str) -> CacheMode:
    for mode in CACHE_MODES:
        if text == mode:
            return mode
    raise ValueError(f"unknown cache mode {text!r}")


@dataclass(frozen=True, kw_only=True)  # kw_only: required options may follow --version
class AgentSettings:
    """Everything an agent needs to know, decided once at start."""

    repository: Path = field(
        metadata=options.required("--repository", parse=Path, help="model repository folder")
    )
    servable: str = field(
        metadata=options.required("--servable", help="servable name (a folder of the repository)")
    )
    version: int | None = option(  # None: the highest version in the repository
        "--version",
        parse=positive_int,
        help="servable version (default: the highest in the repository)",
    )
    rank: int = field(
        metadata=options.required(
            "--rank", parse=non_negative_int, help="the rank this agent serves"
        )
    )
    threads: int = option(
        "--threads",
        None,
        parse=threads_count,
        help=THREADS_HELP,
        to_field=lambda count: count or usable_cores(),  # None: "auto"
    )
    cache_dir: Path | None = option(  # None: the default folder (see CACHE_DIR_HELP)
        "--cache-dir", parse=Path, help=CACHE_DIR_HELP
    )
    use_cache: bool = option(
        "--no-cache", True, kind="off_switch", help="do not use the compile cache"
    )
    cache_mode: CacheMode = option(
        "--cache-mode", "standard", choices=CACHE_MODES, help=CACHE_MODE_HELP, to_field=_cache_mode
    )
    share_weights: bool = option("--share-weights", True, kind="switch", help=SHARE_WEIGHTS_HELP)
    fused: bool = option("--fused", True, kind="switch", help=FUSED_HELP)
    max_memory_mb: int | None = option("--max-memory-mb", parse=positive_int, help=MEMORY_HELP)
    kv_cache_mb: int | None = (
        option(  # None: from free memory and the cap (generation/kv_budget.py)
            "--kv-cache-mb", parse=positive_int, help=KV_CACHE_HELP
        )
    )
    heartbeat_interval: float = option(
        "--heartbeat-interval", 1.0, parse=positive_float, help="seconds between heartbeats"
    )
    drain_seconds: float = option(
        "--drain-seconds",
        10.0,
        parse=float,
        help="on SIGTERM, how long the job in flight may take to finish (default 10)",
        to_field=lambda seconds: max(0.0, seconds),
    )
    broker: BrokerSettings = field(default_factory=BrokerSettings)

    def default_cache_dir(self, version: int, environ: Mapping[str, str] | None = None) -> Path:
        return default_cache_dir(self.servable, version, self.rank, environ)

    def resolved_cache_dir(self, version: int) -> Path | None:
        """The compile cache folder, or None when the cache is off."""
        if not self.use_cache:
            return None
        return self.cache_dir or self.default_cache_dir(version)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The agent's command line; every option defaults from SHARDSERVE_AGENT_<OPTION>."""
    return options.build_parser(
        AgentSettings,
        os.environ if environ is None else environ,
        prefix=ENV_PREFIX,
        prog="shardserve_agent",
        description="Serve one rank of a servable: load its ONNX slice, run stage work, "
        "exchange collectives with the stage's other ranks over RabbitMQ.",
    )


def parse_settings(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentSettings:
    """Parse the command line (exits with code 2 on a usage error)."""
    env = os.environ if environ is None else environ
    args = build_parser(env).parse_args(argv)
    return AgentSettings(
        **options.option_values(AgentSettings, args), broker=BrokerSettings.from_env(env)
    )
