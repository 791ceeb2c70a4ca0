"""What a rank answers to its work, built in one place: StageResult and StepResult.

Either answer names the work it answers (its id, servable, version and stage) and this
rank. A success carries the digest, the timing and what the rank ships; it is built from
values made here, not read from the wire, so it skips re-validation (``model_construct``).
A failure carries an ErrorInfo and is validated like any message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import (
    ErrorInfo,
    StageResult,
    StageWork,
    StepResult,
    StepWork,
    TokenLogprob,
)
from shardserve.wire.tensors import Tensor


class _Address(TypedDict):
    """The fields every answer shares: the work's place in the mesh and this rank."""

    servable: str
    version: int
    stage: int
    rank: int


@dataclass(frozen=True)
class Timing:
    """Where a job's or step's time went on this rank."""

    compute_ms: float = 0.0
    collective_ms: float = 0.0  # waiting for peers


@dataclass(frozen=True)
class Sampled:
    """The tokens the last stage's leader sampled, one per logit row."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    broken: tuple[int, ...] = ()  # rows not finite: their sequences end (sample_rows)


@dataclass(frozen=True)
class StepOutcome:
    """What a step computed on this rank, before it becomes a StepResult."""

    digest: str
    sampled: Sampled
    outputs: dict[str, Tensor] | None = None  # shipped: a middle stage's leader
    iteration: int = 0
    answers: bool = True  # False: combined at the leader, whose result answers for us


def _address(work: StageWork | StepWork, rank: int) -> _Address:
    return _Address(servable=work.servable, version=work.version, stage=work.stage, rank=rank)


def stage_done(
    work: StageWork, rank: int, outputs: dict[str, Tensor] | None, digest: str, timing: Timing
) -> StageResult:
    """A job's success; ``outputs`` only from the stage leader (None from the others)."""
    return StageResult.model_construct(
        job=work.job,
        **_address(work, rank),
        digest=digest,
        outputs=outputs,
        error=None,
        compute_ms=timing.compute_ms,
        collective_ms=timing.collective_ms,
    )


def stage_failed(work: StageWork, rank: int, code: ErrorCode, message: str) -> StageResult:
    return StageResult(
        job=work.job, **_address(work, rank), error=ErrorInfo(code=code, message=message)
    )


def step_done(
    work: StepWork, rank: int, outcome: StepOutcome, timing: Timing, kv_used_bytes: int
) -> StepResult:
    """A step's success (or, in a decode run, one iteration's tokens before the last)."""
    return StepResult.model_construct(
        step=work.step,
        **_address(work, rank),
        digest=outcome.digest,
        outputs=outcome.outputs,
        tokens=outcome.sampled.tokens,
        logprobs=outcome.sampled.logprobs,
        broken_rows=outcome.sampled.broken,
        error=None,
        compute_ms=timing.compute_ms,
        collective_ms=timing.collective_ms,
        kv_used_bytes=kv_used_bytes,
        iteration=outcome.iteration,
    )


def step_failed(
    work: StepWork, rank: int, code: ErrorCode, message: str, kv_used_bytes: int
) -> StepResult:
    return StepResult(
        step=work.step,
        **_address(work, rank),
        error=ErrorInfo(code=code, message=message),
        kv_used_bytes=kv_used_bytes,
    )
