"""What every wire message shares: the frozen base with its schema version, errors, results."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardserve.errors import ErrorCode
from shardserve.wire.tensors import Tensor

SCHEMA_VERSION = 1

TensorMap = dict[str, Tensor]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = 1


class ErrorInfo(BaseModel):
    """An error as it travels: a code and a message meant for the caller."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: ErrorCode
    message: str
    # > 0 on an overload refusal that may succeed later: the HTTP Retry-After.
    retry_after_s: float = Field(default=0.0, ge=0.0)


class InstanceResult(BaseModel):
    """The outcome of one instance: its outputs, or its error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outputs: TensorMap | None = None
    error: ErrorInfo | None = None
