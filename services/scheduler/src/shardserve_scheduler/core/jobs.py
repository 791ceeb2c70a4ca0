"""Requests, instances and jobs as the state machine keeps them, and pure helpers.

A *request* is one InferRequest; each of its *instances* walks the method's steps
(Python stages, the model). A *job* is one model run serving *members*: (request key,
instance index, chunk index, step position) — several instances of several requests when
batched, or a chunk of an instance larger than the maximum batch size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardserve.errors import ErrorCode
from shardserve.repo.repository import GroupConfig
from shardserve.wire.protocol import ErrorInfo, InferRequest, InstanceResult, StageResult, TensorMap
from shardserve_scheduler.core.batching import Batcher, Member
from shardserve_scheduler.core.methods import Env, MethodPlan
from shardserve_scheduler.core.timeline import Timeline

_PASSED_THROUGH_CODES = frozenset(
    {ErrorCode.INTERNAL, ErrorCode.STAGE_FAILED, ErrorCode.DEADLINE, ErrorCode.RANK_MISMATCH}
)

LaneKey = tuple[str, int]


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

    @property
    def lane_key(self) -> LaneKey:
        return (self.group.servable, self.group.version)


@dataclass
class InstanceState:
    env: Env
    step: int = 0  # position in the method's steps
    chunks: list[TensorMap | None] = field(default_factory=list)
    outcome: InstanceResult | None = None
    where: str = "queued"  # for deadline messages


@dataclass
class RequestState:
    key: str
    call: Call
    accepted_at: float
    instances: list[InstanceState]
    jobs: set[str] = field(default_factory=set)

    @property
    def open_instances(self) -> int:
        return sum(1 for i in self.instances if i.outcome is None)


@dataclass
class Job:
    """One model run; ``ranges`` are the members' rows in a batch (None: one whole member)."""

    id: str
    group: GroupConfig
    members: tuple[Member, ...]
    ranges: tuple[tuple[int, int], ...] | None
    inputs: TensorMap
    deadline: float
    timeline: Timeline
    stage: int = -1  # -1: queued, not yet published
    results: dict[int, StageResult] = field(default_factory=dict)
    stacked: int = 0  # > 0: that many instances stacked (a model without a batch dim)

    @property
    def servable(self) -> str:
        return self.group.servable

    @property
    def lane_key(self) -> LaneKey:
        return (self.group.servable, self.group.version)

    def stage_ranks(self) -> tuple[int, ...]:
        return self.group.stages[self.stage].ranks

    def silent_ranks(self) -> list[int]:
        return [r for r in self.stage_ranks() if r not in self.results] if self.stage >= 0 else []


@dataclass
class VersionStats:
    requests_total: int = 0
    errors_total: int = 0
    batches_total: int = 0
    batched_instances_total: int = 0


@dataclass
class Lane:
    """Jobs of one servable version: in flight, waiting (FIFO), and pieces being batched."""

    group: GroupConfig
    batcher: Batcher | None = None
    no_batch: frozenset[str] = frozenset()
    stacking: bool = False  # the batcher stacks instances (no batch dim) instead of rows
    inflight: set[str] = field(default_factory=set)
    queued: deque[Job] = field(default_factory=deque)

    @property
    def waiting(self) -> int:
        return len(self.queued) + (len(self.batcher) if self.batcher is not None else 0)

    @property
    def hungry(self) -> bool:
        """Whether a batch that is due should leave now.

        While every stage already has a job (in flight or queued), a due batch stays open
        and keeps growing up to the batch limit: instances that arrive while the ranks are
        busy join one job instead of queueing as many small ones. That is where batching
        pays. The next job completion (or a full batch) lets it go."""
        return len(self.inflight) + len(self.queued) < self.group.stage_size


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
    late_python_results: int = 0


def rank_error(job: Job, rank: int, error: ErrorInfo) -> tuple[ErrorCode, str]:
    code = error.code if error.code in _PASSED_THROUGH_CODES else ErrorCode.STAGE_FAILED
    return code, (
        f"rank {rank} failed stage {job.stage} of {job.servable} "
        f"v{job.group.version}: {error.message}"
    )


def stage_answered(job: Job) -> bool:
    """Whether every rank the stage must hear from has answered: all of its ranks, or its
    leader alone where the stage's outputs are combined at the leader (the other ranks'
    parts are in the leader's result; they answer only with an error)."""
    if len(job.results) == len(job.stage_ranks()):
        return True
    leader_answered = job.group.leader_of(job.stage) in job.results
    return leader_answered and job.group.stages[job.stage].outputs_at_leader


def digest_disagreement(job: Job) -> str:
    """'' if every rank of the stage that answered reported the same digest, else who
    said what."""
    by_digest: dict[str, list[int]] = {}
    for rank in sorted(job.results):
        by_digest.setdefault(job.results[rank].digest, []).append(rank)
    if len(by_digest) <= 1:
        return ""
    groups = sorted(by_digest.items(), key=lambda item: item[1][0])
    parts = [f"ranks {ranks} digest {digest[:12]}..." for digest, ranks in groups]
    return f"ranks disagree on stage {job.stage} output: {', '.join(parts)}"


def collapsed_error(results: list[InstanceResult]) -> ErrorInfo | None:
    """The one error of a request whose every instance failed the same way (MindSpore
    collapses those into a request-level error), else None."""
    errors = [r.error for r in results]
    if not errors or any(e is None for e in errors):
        return None
    first = errors[0]
    assert first is not None
    return first if all(e == first for e in errors) else None
