"""Inference messages: requests and replies (one, or bundled), stage work, its results
and the collective parts of a stage (generation steps reuse ``CollectivePart``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardserve.wire.bounds import Count, Deadline, Text
from shardserve.wire.message import ErrorInfo, InstanceResult, TensorMap, _Message
from shardserve.wire.tensors import Tensor

# ---------------------------------------------------------------- inference (public)


class InferRequest(_Message):
    """One call of a servable's method, from a gateway or any other system.

    ``instances`` follows MindSpore Serving: each instance is a dict of named inputs; a
    KServe v2 request is one instance. ``version`` 0 means the highest ready version.
    ``deadline`` is absolute (unix seconds). The reply goes to the AMQP ``reply_to``
    property, with the ``correlation_id`` the request carried (``id`` is the caller's own
    request id, for logs; it need not be unique).
    """

    kind: Literal["infer.request"] = "infer.request"
    id: Text = Field(min_length=1, max_length=128)
    servable: Text = Field(min_length=1, max_length=128)
    version: Count = 0
    method: Text = Field(default="predict", min_length=1, max_length=128)
    instances: tuple[TensorMap, ...] = Field(min_length=1)
    outputs: tuple[Text, ...] | None = None
    deadline: Deadline


class InferReply(_Message):
    """The single outcome of an InferRequest: per-instance results, or one error."""

    kind: Literal["infer.reply"] = "infer.reply"
    id: str
    servable: str
    version: int = 0
    method: str = ""
    instances: tuple[InstanceResult, ...] = ()
    error: ErrorInfo | None = None


class BundledRequest(BaseModel):
    """One request of a bundle, with the correlation id its reply must carry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    correlation_id: str = Field(min_length=1, max_length=128)
    request: InferRequest


class InferRequestBundle(_Message):
    """Several InferRequests in one message (one publish, one confirm, one delivery).

    A gateway groups the requests that arrive while its previous publish is in flight
    (group commit: no added delay when idle). Each request is admitted (or refused) on its
    own, as if it had come alone with the bundle's ``reply_to`` and its own
    ``correlation_id``; then the bundle's instances start together, sharing jobs. A
    sender of bundles says by that that it also understands InferReplyBundle on its
    ``reply_to``: the scheduler may then answer several requests in one message.
    """

    kind: Literal["infer.request.bundle"] = "infer.request.bundle"
    requests: tuple[BundledRequest, ...] = Field(min_length=1, max_length=1024)


class BundledReply(BaseModel):
    """One reply of a bundle, with the correlation id of its request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    correlation_id: str
    reply: InferReply


class InferReplyBundle(_Message):
    """Several InferReplies to one ``reply_to`` in one message; sent only to reply queues
    that have sent an InferRequestBundle (a plain InferRequest client never sees one)."""

    kind: Literal["infer.reply.bundle"] = "infer.reply.bundle"
    replies: tuple[BundledReply, ...] = Field(min_length=1)


# ---------------------------------------------------------------- data plane (internal)


class StageWork(_Message):
    """The input of one job for one pipeline stage; one publish reaches every rank of it.

    A job is one model run: one instance, or several instances batched together.
    ``digest`` is ``digest_tensors(inputs)``; every rank checks it before running.
    """

    kind: Literal["stage.work"] = "stage.work"
    job: str
    servable: str
    version: int
    stage: int = Field(ge=0)
    inputs: TensorMap
    digest: str
    deadline: float
    result_to: str
    requests: tuple[str, ...] = ()
    # > 0: the inputs are that many instances of a servable without a batch dimension,
    # stacked on a new leading axis; each rank runs its segments once per instance and
    # exchanges their collective parts together (see shardserve.runtime.program.run_stage).
    stacked: int = Field(default=0, ge=0)


class StageResult(_Message):
    """One rank's outcome of a job's stage: the digest of its outputs, and (from the
    stage's leader rank) the outputs themselves.

    Where a stage's outputs are combined at its leader (``StageSpec.final_collectives``)
    the other ranks hold none and answer only with an error: the leader's result, made
    from every rank's part, speaks for them.
    """

    kind: Literal["stage.result"] = "stage.result"
    job: str
    servable: str
    version: int
    stage: int
    rank: int
    digest: str = ""
    outputs: TensorMap | None = None
    error: ErrorInfo | None = None
    compute_ms: float = 0.0
    collective_ms: float = 0.0


class CollectivePart(_Message):
    """One rank's contribution to collective ``step`` of a job's stage.

    ``phase`` tells the messages of one step apart where an algorithm has several: a
    whole part (or a leader's combined result), or, in a sharded allreduce, one shard of
    the sender's part (sent to the rank that sums it) and a summed shard (to every rank).
    """

    kind: Literal["coll.part"] = "coll.part"
    job: str
    stage: int
    step: int
    rank: int
    tensor: Tensor
    phase: Literal["part", "shard", "reduced"] = "part"
