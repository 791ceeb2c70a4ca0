"""Requests and jobs as the state machine keeps them, and pure helpers about them.

A *request* is one InferRequest; a *job* is one model run serving (request, instance)
members. Today every job has exactly one member.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardserve.errors import ErrorCode
from shardserve.protocol import ErrorInfo, InferRequest, StageResult, TensorMap
from shardserve.repository import GroupConfig
from shardserve_scheduler.catalog import MethodPlan
from shardserve_scheduler.timeline import Timeline

_PASSED_THROUGH_CODES = frozenset(
    {ErrorCode.INTERNAL, ErrorCode.STAGE_FAILED, ErrorCode.DEADLINE, ErrorCode.RANK_MISMATCH}
)


@dataclass(frozen=True)
class Call:
    """A request the scheduler resolved and validated, with where its reply goes."""

    request: InferRequest
    reply_to: str
    correlation_id: str
    group: GroupConfig
    method: MethodPlan

    @property
    def label(self) -> str:
        return f"{self.group.servable} v{self.group.version}"


@dataclass
class RequestState:
    key: str
    call: Call
    accepted_at: float
    results: list[TensorMap | None]
    jobs: set[str] = field(default_factory=set)
    done: bool = False


@dataclass
class Job:
    """One model run. ``members`` are (request key, instance index) pairs it serves."""

    id: str
    group: GroupConfig
    members: tuple[tuple[str, int], ...]
    inputs: TensorMap
    deadline: float
    timeline: Timeline
    stage: int = -1  # -1: queued, not yet published
    results: dict[int, StageResult] = field(default_factory=dict)

    @property
    def servable(self) -> str:
        return self.group.servable

    def stage_ranks(self) -> tuple[int, ...]:
        return self.group.stages[self.stage].ranks

    def silent_ranks(self) -> list[int]:
        return [r for r in self.stage_ranks() if r not in self.results] if self.stage >= 0 else []


@dataclass
class Lane:
    """Jobs of one servable: the ones in flight and the FIFO of the ones waiting."""

    inflight: set[str] = field(default_factory=set)
    queued: deque[Job] = field(default_factory=deque)


@dataclass
class Counters:
    accepted: int = 0
    replied: int = 0
    succeeded: int = 0
    failed: int = 0
    overloaded: int = 0
    late_results: int = 0
    duplicate_results: int = 0
    stray_results: int = 0


def rank_error(job: Job, rank: int, error: ErrorInfo) -> tuple[ErrorCode, str]:
    code = error.code if error.code in _PASSED_THROUGH_CODES else ErrorCode.STAGE_FAILED
    return code, (
        f"rank {rank} failed stage {job.stage} of {job.servable} "
        f"v{job.group.version}: {error.message}"
    )


def digest_disagreement(job: Job) -> str:
    """'' if every rank of the stage reported the same digest, else who said what."""
    by_digest: dict[str, list[int]] = {}
    for rank in sorted(job.results):
        by_digest.setdefault(job.results[rank].digest, []).append(rank)
    if len(by_digest) <= 1:
        return ""
    groups = sorted(by_digest.items(), key=lambda item: item[1][0])
    parts = [f"ranks {ranks} digest {digest[:12]}..." for digest, ranks in groups]
    return f"ranks disagree on stage {job.stage} output: {', '.join(parts)}"
