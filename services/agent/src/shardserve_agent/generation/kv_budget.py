"""How many bytes this rank's KV cache may hold, and the cache itself (generation servables).

``--kv-cache-mb`` sets the budget. Without it the budget is the smallest of
``DEFAULT_CAP_MB``, ``AVAILABLE_SHARE`` of the memory available now (``MemAvailable``) minus
the slice, and, under ``--max-memory-mb``, ``CAPPED_SHARE`` of the room the cap still
leaves. That room is the cap minus the private writable memory in use once the slice is
loaded (``VmData``: what RLIMIT_DATA, the cap, counts: the slice, and the runtime's heap,
thread stacks and buffers as well) minus ``SERVING_MB``, what serving adds to it before
any sequence is cached; the other half is left for the steps' activations and messages.
An explicit budget above that room is lowered to it, with a warning: a cache the cap
cannot hold would fail at an allocation in the middle of serving instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.kv_shape import cache_shape, is_generation
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import LoadedSlice

_logger = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_CAP_MB = 4096
AVAILABLE_SHARE = 0.6
CAPPED_SHARE = 0.5
# Measured on the TP-4 agents of tests/integration/test_generation_capped.py: 298 MiB once
# the slice is loaded, 314 registered (the broker connection), 321 after the first steps.
SERVING_MB = 32


@dataclass(frozen=True)
class MemoryNow:
    """What the host and this process use now (None where /proc cannot tell)."""

    available_bytes: int | None  # /proc/meminfo MemAvailable
    data_bytes: int | None  # /proc/self/status VmData: what the cap (RLIMIT_DATA) counts


@dataclass(frozen=True)
class KvBudget:
    bytes: int
    lowered_from: int | None = None  # the --kv-cache-mb bytes, when the cap lowered them


def kv_budget(
    requested_mb: int | None, max_memory_mb: int | None, slice_bytes: int, memory: MemoryNow
) -> KvBudget:
    """The KV budget in bytes (see the module docstring); never negative."""
    room = _room_under_cap(max_memory_mb, slice_bytes, memory)
    if requested_mb is not None:
        requested = requested_mb * MIB
        if room is not None and requested > room:
            return KvBudget(room, lowered_from=requested)
        return KvBudget(requested)
    budget = DEFAULT_CAP_MB * MIB
    if memory.available_bytes is not None:
        budget = min(budget, int(memory.available_bytes * AVAILABLE_SHARE) - slice_bytes)
    if room is not None:
        budget = min(budget, int(room * CAPPED_SHARE))
    return KvBudget(max(budget, 0))


def _room_under_cap(max_memory_mb: int | None, slice_bytes: int, memory: MemoryNow) -> int | None:
    if max_memory_mb is None:
        return None
    used = slice_bytes if memory.data_bytes is None else memory.data_bytes
    return max(max_memory_mb * MIB - used - SERVING_MB * MIB, 0)


def read_memory(proc: Path = Path("/proc")) -> MemoryNow:
    return MemoryNow(
        available_bytes=_kib_field(proc / "meminfo", "MemAvailable:"),
        data_bytes=_kib_field(proc / "self" / "status", "VmData:"),
    )


def _kib_field(path: Path, label: str) -> int | None:
    """A ``Label:   123 kB`` line of a /proc file, in bytes."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(label):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def make_kv_cache(settings: AgentSettings, loaded: LoadedSlice) -> KVCache | None:
    """This rank's (empty) KV cache when the servable generates text; else None."""
    if not is_generation(loaded.group):
        return None
    budget = kv_budget(
        settings.kv_cache_mb, settings.max_memory_mb, loaded.disk_bytes, read_memory()
    )
    if budget.lowered_from is not None:
        _logger.warning(
            "--kv-cache-mb %d MB does not fit under --max-memory-mb %d MB with the slice "
            "loaded; the KV cache gets %.1f MB",
            budget.lowered_from // MIB,
            settings.max_memory_mb,
            budget.bytes / MIB,
        )
    cache = KVCache(cache_shape(loaded.group, loaded.rank), budget.bytes)
    _logger.info(
        "KV cache: %.1f MB for %d layer(s), %d bytes per token (%d tokens)",
        budget.bytes / MIB,
        len(cache.shape.layers),
        cache.bytes_per_token,
        budget.bytes // max(cache.bytes_per_token, 1),
    )
    return cache
