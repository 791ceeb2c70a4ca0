"""Wire messages: frozen pydantic models with a ``Literal`` kind and a schema version.

Every message body on the broker is one of these, msgpack-encoded by ``shardserve.wire.codec``.
The ``kind`` field is the discriminator; ``v`` is the schema version and must equal
``SCHEMA_VERSION`` (a consumer dead-letters anything else). Fields are added with
defaults from release to release (``CollectivePart.phase``, ``StageWork.stacked``)
and unknown fields are refused, so the services of one mesh run
one shardserve release: an older consumer dead-letters a newer message, never half-reads it.

Flow of one request (see docs/architecture.md):

    InferRequest  gateway/other system -> scheduler            (exchange shardserve.requests)
    StageWork     scheduler -> every rank of one stage         (exchange shardserve.stage)
    CollectivePart rank -> every rank of its stage             (exchange shardserve.collective)
    StageResult   rank -> scheduler                            (default exchange, result queue)
    InferReply    scheduler -> reply_to of the request         (default exchange)

Flow of one generation (a sequence advanced step by step; see docs/architecture.md):

    GenerateRequest / GenerateCancel  caller -> scheduler      (exchange shardserve.requests)
    StepWork / SequencesFree  scheduler -> every rank of one stage (exchange shardserve.stage)
    StepResult    rank -> scheduler (the last stage's leader adds the sampled tokens)
    GenerateChunk scheduler -> reply_to, numbered, the last with finish reason or error

A gateway sends the requests that pile up while a publish is in flight as one
InferRequestBundle; the scheduler answers such a sender's replies that are ready together
as one InferReplyBundle (fewer messages per request through the broker and both services).

Control plane (exchange shardserve.control): AgentHello/AgentHeartbeat/AgentBye from
agents, RegistrationVerdict to one agent, SchedulerHello and MeshStatus from the scheduler,
JobCancel to the ranks of a group, RepositoryCommand (load/unload a version) to the
scheduler.

The messages live by flow in ``shardserve.wire.inference``, ``shardserve.wire.generation``
and ``shardserve.wire.control`` (their shared base in ``shardserve.wire.message``); this
module is the one decode union over all of them, and re-exports every message so
``from shardserve.wire.protocol import X`` keeps working.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter

from shardserve.wire.control import (
    AgentBye,
    AgentHeartbeat,
    AgentHello,
    JobCancel,
    MeshStatus,
    MethodStatus,
    RankReport,
    RankStatus,
    RegistrationVerdict,
    RepositoryCommand,
    SchedulerHello,
    ServableStatus,
    TensorSpec,
)
from shardserve.wire.generation import (
    MAX_LOGIT_BIAS,
    ChatMessage,
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    LogitBias,
    RowSampling,
    SamplingParams,
    SequenceReservation,
    SequencesFree,
    SequenceSpan,
    StepResult,
    StepWork,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shardserve.wire.inference import (
    BundledReply,
    BundledRequest,
    CollectivePart,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
    StageResult,
    StageWork,
)
from shardserve.wire.message import (
    SCHEMA_VERSION,
    ErrorInfo,
    InstanceResult,
    TensorMap,
    _Message,
)

__all__ = [
    "AgentBye",
    "AgentHeartbeat",
    "AgentHello",
    "BundledReply",
    "BundledRequest",
    "ChatMessage",
    "CollectivePart",
    "ErrorInfo",
    "GenerateCancel",
    "GenerateChunk",
    "GenerateRequest",
    "InferReply",
    "InferReplyBundle",
    "InferRequest",
    "InferRequestBundle",
    "InstanceResult",
    "JobCancel",
    "LogitBias",
    "MAX_LOGIT_BIAS",
    "MESSAGE_ADAPTER",
    "MESSAGE_TYPES",
    "MeshStatus",
    "Message",
    "MethodStatus",
    "RankReport",
    "RankStatus",
    "RegistrationVerdict",
    "RepositoryCommand",
    "RowSampling",
    "SCHEMA_VERSION",
    "SamplingParams",
    "SchedulerHello",
    "SequenceReservation",
    "SequenceSpan",
    "SequencesFree",
    "ServableStatus",
    "StageResult",
    "StageWork",
    "StepResult",
    "StepWork",
    "TensorMap",
    "TensorSpec",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]

Message = Annotated[
    InferRequest
    | InferReply
    | InferRequestBundle
    | InferReplyBundle
    | GenerateRequest
    | GenerateCancel
    | GenerateChunk
    | StageWork
    | StageResult
    | StepWork
    | StepResult
    | SequencesFree
    | CollectivePart
    | AgentHello
    | AgentHeartbeat
    | AgentBye
    | RegistrationVerdict
    | SchedulerHello
    | JobCancel
    | RepositoryCommand
    | MeshStatus,
    Field(discriminator="kind"),
]

MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)

MESSAGE_TYPES: tuple[type[_Message], ...] = (
    InferRequest,
    InferReply,
    InferRequestBundle,
    InferReplyBundle,
    GenerateRequest,
    GenerateCancel,
    GenerateChunk,
    StageWork,
    StageResult,
    StepWork,
    StepResult,
    SequencesFree,
    CollectivePart,
    AgentHello,
    AgentHeartbeat,
    AgentBye,
    RegistrationVerdict,
    SchedulerHello,
    JobCancel,
    RepositoryCommand,
    MeshStatus,
)
