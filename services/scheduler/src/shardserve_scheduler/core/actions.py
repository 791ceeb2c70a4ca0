"""What the pure core asks the shell to do: publish, reply, cancel, run Python, log.

The core never touches the broker; it returns these, in the order they must happen.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

from shardserve.errors import ErrorCode
from shardserve.wire import topology
from shardserve.wire.protocol import (
    ErrorInfo,
    GenerateChunk,
    InferReply,
    InferRequest,
    JobCancel,
    SequencesFree,
    StageWork,
    StepWork,
)
from shardserve_scheduler.core.pystages import PythonTask


@dataclass(frozen=True)
class PublishStageWork:
    """One job's input for one stage; one publish reaches every rank of the stage."""

    work: StageWork

    @property
    def routing_key(self) -> str:
        return topology.stage_key(self.work.servable, self.work.version, self.work.stage)


@dataclass(frozen=True)
class Reply:
    """The single outcome of a request, to its reply_to queue."""

    reply_to: str
    correlation_id: str
    reply: InferReply


@dataclass(frozen=True)
class Cancel:
    """Tell every rank of a group to drop a job that already has an outcome."""

    cancel: JobCancel

    @property
    def routing_key(self) -> str:
        return topology.group_key(self.cancel.servable, self.cancel.version)


@dataclass(frozen=True)
class RunPython:
    """Run a Python stage task in the worker pool; feed the outcome back to the core."""

    task: PythonTask


@dataclass(frozen=True)
class PublishStep:
    """One generation step for one stage; sent like StageWork (same key, same channel), so
    every rank of the stage sees steps and jobs in one order."""

    work: StepWork

    @property
    def routing_key(self) -> str:
        return topology.stage_key(self.work.servable, self.work.version, self.work.stage)


@dataclass(frozen=True)
class PublishFree:
    """Ranks of one stage free sequences' KV caches; keeps its place among the steps."""

    free: SequencesFree

    @property
    def routing_key(self) -> str:
        return topology.stage_key(self.free.servable, self.free.version, self.free.stage)


@dataclass(frozen=True)
class SendChunk:
    """One chunk of a generation's stream, to its reply_to; every chunk is confirmed, on
    one channel, each after the one before (RabbitMQ orders only within a channel)."""

    reply_to: str
    correlation_id: str
    chunk: GenerateChunk


@dataclass(frozen=True)
class Log:
    level: int
    message: str
    request_id: str = "-"


Action = PublishStageWork | Reply | Cancel | RunPython | Log | PublishStep | PublishFree | SendChunk


def error_reply(
    request: InferRequest,
    reply_to: str,
    correlation_id: str,
    code: ErrorCode,
    message: str,
    *,
    version: int | None = None,
) -> Reply:
    """A reply that carries one error for the whole request."""
    reply = InferReply(
        id=request.id,
        servable=request.servable,
        version=request.version if version is None else version,
        method=request.method,
        error=ErrorInfo(code=code, message=message),
    )
    return Reply(reply_to, correlation_id, reply)


def debug(message: str, request_id: str = "-") -> Log:
    return Log(logging.DEBUG, message, request_id)


def bug_message(doing: str, exc: Exception) -> str:
    """What a client is told when the scheduler failed at ``doing`` with an unexpected
    exception (a bug): that, the exception's type and its message."""
    return f"scheduler error {doing}: {type(exc).__name__}: {exc}"


def bug_log(message: str, request_id: str = "-") -> Log:
    """The error log of a bug the core caught: its message and the traceback (called while
    the exception is being handled)."""
    return Log(logging.ERROR, f"{message}\n{traceback.format_exc()}", request_id)
