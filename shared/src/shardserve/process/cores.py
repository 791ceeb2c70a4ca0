"""How many CPU cores this process may use, and the onnxruntime threads an agent gets.

``os.cpu_count()`` counts the machine's cores. A process may use fewer: its CPU affinity
(``taskset``, a cpuset) and a cgroup CPU quota (a container's ``--cpus``, a Kubernetes CPU
limit) both cap it. onnxruntime threads beyond those cores only preempt each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THREADS_AUTO = "auto"


def usable_cores(
    cgroup_root: Path = CGROUP_ROOT,
    affinity: Callable[[], int] | None = None,
) -> int:
    """Cores this process may use: its affinity, capped by its cgroup's CPU quota (at
    least 1; a fractional quota rounds down, 0.5 CPU gives 1)."""
    cores = affinity() if affinity is not None else _affinity()
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota in cores (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None when there is none or it cannot be read."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _ratio(quota, period)
    quota_us = _read(root / "cpu" / "cpu.cfs_quota_us")
    period_us = _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_us is None or period_us is None:
        return None
    return _ratio(quota_us, period_us)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    """quota / period, or None for "max", -1 (no quota) or anything unreadable."""
    try:
        q, p = float(quota), float(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def threads_per_agent(agents: int, cores: int, requested: int | None = None) -> int:
    """onnxruntime intra-op threads for each of ``agents`` agents on one host of ``cores``
    usable cores: an even share of the cores (at least 1), or ``requested`` when it is
    smaller. More than the share is never given: with every agent's sessions busy at once
    (tensor parallel ranks step together) extra threads only preempt each other; measured
    at 2 ranks on 2 cores, ``--threads 2`` made c32 throughput 18 % lower than 1. No core
    is held back for the gateway, scheduler and broker: onnxruntime's workers sleep when
    idle (``shardserve.runtime.thread_pools``), and a 1-rank mesh on 2 cores served c1 at
    21 ms a token with 2 threads against 28 with 1 (c32: 180 against 123 tokens/s)."""
    share = max(1, cores // max(agents, 1))
    return share if requested is None else min(requested, share)


def parse_threads(text: str) -> int | None:
    """A ``--threads`` value: a positive count, or ``auto`` (None: decided from the cores)."""
    if text.strip().lower() == THREADS_AUTO:
        return None
    problem = f"expected a positive number of threads or '{THREADS_AUTO}', got {text!r}"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(problem) from None
    if value < 1:
        raise ValueError(problem)
    return value
