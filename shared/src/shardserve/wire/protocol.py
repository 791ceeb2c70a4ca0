"""Wire messages: frozen pydantic models with a ``Literal`` kind and a schema version.

Every message body on the broker is one of these, msgpack-encoded by ``shardserve.wire.codec``.
The ``kind`` field is the discriminator; ``v`` is the schema version and must equal
``SCHEMA_VERSION`` (a consumer dead-letters anything else). Fields are added with
defaults from release to release (``CollectivePart.phase``, ``StageWork.stacked``)
and unknown fields are refused, so the services of one mesh run
one shardserve release: an older consumer dead-letters a newer message, never half-reads it.

Flow of one request (see README, "Architecture"):

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
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

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
    id: str = Field(min_length=1, max_length=128)
    servable: str = Field(min_length=1, max_length=128)
    version: int = Field(default=0, ge=0)
    method: str = Field(default="predict", min_length=1, max_length=128)
    instances: tuple[TensorMap, ...] = Field(min_length=1)
    outputs: tuple[str, ...] | None = None
    deadline: float


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


# ---------------------------------------------------------------- generation (public)


class SamplingParams(BaseModel):
    """How one sequence chooses its tokens and when it stops.

    ``temperature`` 0 is greedy (the lowest token id wins a tie). With a ``seed`` the
    choice of token ``i`` of the sequence depends only on (seed, i) and the logits, so a
    sequence samples the same tokens alone or in any batch. ``stop`` strings end the text
    before the match (the match is not returned); ``stop_token_ids`` and the model's EOS ids
    (unless ``ignore_eos``) end it after the token, which is not part of the text either.
    ``logprobs`` N > 0 returns the chosen token's log-probability and the N most likely.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=16, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0: no top-k cut
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=16
    )
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = Field(default=(), max_length=64)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatMessage(BaseModel):
    """One message of a chat, rendered with the checkpoint's chat template."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str = Field(min_length=1, max_length=64)
    content: str


class GenerateRequest(_Message):
    """Generate text from a prompt (text, token ids, or chat messages: exactly one).

    The answer is a stream of GenerateChunk messages to ``reply_to`` with the request's
    ``correlation_id``, numbered from 0; the last has a ``finish_reason`` or an ``error``.
    A GenerateCancel with the same ``reply_to`` and ``correlation_id`` stops it.
    """

    kind: Literal["generate.request"] = "generate.request"
    id: str = Field(min_length=1, max_length=128)
    servable: str = Field(min_length=1, max_length=128)
    version: int = Field(default=0, ge=0)
    prompt: str | None = None
    prompt_ids: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    deadline: float

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, prompt_ids and messages must be given "
                f"(given: {', '.join(given) or 'none'})"
            )
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class GenerateCancel(_Message):
    """Stop a generation (the caller left): its sequence leaves the mesh within one step,
    its KV cache is freed on every rank, and its stream ends with a ``cancelled`` error.
    Published like the request (same exchange and key), so it never overtakes it."""

    kind: Literal["generate.cancel"] = "generate.cancel"
    reply_to: str = Field(min_length=1, max_length=255)
    correlation_id: str = Field(min_length=1, max_length=128)


class TopLogprob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: int
    text: str
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token, its log-probability, and the most likely alternatives."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class GenerateChunk(_Message):
    """One message of a generation's stream: new tokens and their text.

    ``seq`` numbers a stream's messages from 0 (a receiver detects a gap or a duplicate).
    ``text`` is the text the new tokens complete; bytes of a character not yet complete
    are held back until a later token completes it, so the texts joined are the text.
    The last message of a stream, and only it, has ``finish_reason`` ("stop": an EOS or
    stop token or string; "length": ``max_tokens`` or the model's context) with ``usage``,
    or ``error``.
    """

    kind: Literal["generate.chunk"] = "generate.chunk"
    id: str
    seq: int = Field(ge=0)
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: Literal["stop", "length"] | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


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

    Where a stage's outputs are combined at its leader (``program.final_collectives``)
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


class SequenceSpan(BaseModel):
    """Rows ``[offset, offset + count)`` of a step's packed tensors are tokens
    ``[start, start + count)`` of sequence ``seq``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    start: int = Field(ge=0)
    count: int = Field(ge=1)


class SequenceReservation(BaseModel):
    """Room for ``capacity`` tokens of a new sequence in every rank's KV cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    capacity: int = Field(ge=1)


class RowSampling(BaseModel):
    """How the last stage's leader picks the next token of one logit row: ``index`` is
    the position of that token among the sequence's generated tokens (for the seeded RNG)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    index: int = Field(ge=0)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None


class StepWork(_Message):
    """One generation step for one pipeline stage: the packed tokens of several sequences
    (prefill chunks and single decode tokens mixed), in one publish to every rank of it.

    Before running, each rank frees ``free`` and reserves ``reserve`` in its KV cache; the
    ``attention`` ops then read and extend the caches of the ``layout``'s sequences. The
    inputs are ``input_ids`` (stage 0) or the previous stage's hidden state, with
    ``positions`` and ``logit_rows``. The last stage's leader samples one token per logit
    row with ``sampling`` (same order) and returns them in its StepResult.

    ``decode_steps`` K > 1 (a *decode run*, only for a group of one stage): every row is a
    one-token decode row with a logit row, and every rank runs K iterations of the stage;
    iteration i + 1's ``input_ids`` are the tokens sampled at iteration i, its positions,
    span starts and sampling indexes are i + 1 further on, its logit rows the same. Every
    rank holds the logits and samples itself (the choice is deterministic). The leader
    reports each iteration i < K - 1 in a StepResult with ``iteration`` i; every rank then
    reports the last (see StepResult).
    """

    kind: Literal["step.work"] = "step.work"
    step: str
    servable: str
    version: int
    stage: int = Field(ge=0)
    inputs: TensorMap
    digest: str
    deadline: float
    result_to: str
    layout: tuple[SequenceSpan, ...] = ()
    reserve: tuple[SequenceReservation, ...] = ()
    free: tuple[int, ...] = ()
    sampling: tuple[RowSampling, ...] = ()
    decode_steps: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _decode_run(self) -> StepWork:
        if self.decode_steps == 1:
            return self
        if any(span.count != 1 for span in self.layout) or len(self.sampling) != len(self.layout):
            raise ValueError(
                f"a step of {self.decode_steps} decode steps must have one token and one "
                "sampled row per sequence"
            )
        return self


class StepResult(_Message):
    """One rank's outcome of a generation step's stage (as StageResult for a job), and from
    the last stage's leader the sampled ``tokens`` (one per logit row) with their logprobs.

    In a decode run of K steps (``StepWork.decode_steps``) the leader sends one result per
    iteration i < K - 1 (``iteration`` i, its tokens, no digest), then every rank sends
    its final result (``iteration`` K - 1, the tokens at the leader) whose ``digest`` is
    that of all K iterations' sampled tokens: the scheduler checks that the ranks agreed.
    An error ends the run at any iteration.
    """

    kind: Literal["step.result"] = "step.result"
    step: str
    servable: str
    version: int
    stage: int
    rank: int
    digest: str = ""
    outputs: TensorMap | None = None
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    error: ErrorInfo | None = None
    compute_ms: float = 0.0
    collective_ms: float = 0.0
    kv_used_bytes: int = 0
    iteration: int = Field(default=0, ge=0)


class SequencesFree(_Message):
    """Ranks free these sequences' KV caches (finished, cancelled or failed between steps).
    Sent on the stage exchange like StepWork, so it keeps its place among the steps."""

    kind: Literal["step.free"] = "step.free"
    servable: str
    version: int
    stage: int = Field(ge=0)
    seqs: tuple[int, ...] = Field(min_length=1)


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


# ---------------------------------------------------------------- control plane


class _AgentState(_Message):
    instance: str
    servable: str
    version: int
    rank: int
    stage: int
    slice_checksum: str
    host: str = ""
    pid: int = 0
    state: Literal["loading", "ready", "draining"] = "ready"
    cache: Literal["hit", "miss", "off"] = "off"
    load_ms: float = 0.0
    rss_bytes: int = 0
    inflight: int = 0
    control_key: str = ""
    jobs_done: int = 0
    compute_ms_total: float = 0.0
    collective_ms_total: float = 0.0
    # generation servables: the rank's KV cache budget, use, and cost of one token
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    kv_bytes_per_token: int = 0
    sequences: int = 0


class AgentHello(_AgentState):
    """An agent asks to join its group (sent at start and when a scheduler says hello)."""

    kind: Literal["agent.hello"] = "agent.hello"


class AgentHeartbeat(_AgentState):
    """An agent is alive; carries its current state."""

    kind: Literal["agent.heartbeat"] = "agent.heartbeat"


class AgentBye(_AgentState):
    """An agent leaves on purpose (drain finished)."""

    kind: Literal["agent.bye"] = "agent.bye"


class RegistrationVerdict(_Message):
    """The scheduler's answer to one agent's hello.

    ``retry_after_s`` > 0 on a refusal means "the rank's previous holder has not timed out
    yet": a restarted agent asks again after that long instead of giving up.
    """

    kind: Literal["agent.verdict"] = "agent.verdict"
    instance: str
    accepted: bool
    reason: str = ""
    retry_after_s: float = 0.0


class SchedulerHello(_Message):
    """A scheduler started: every agent re-sends its hello."""

    kind: Literal["scheduler.hello"] = "scheduler.hello"
    scheduler: str


class RepositoryCommand(_Message):
    """Load (bring up) or unload (drain, then drop) one servable version without a restart.

    Sent by a gateway (model repository extension) or an operator to key
    ``scheduler.command``; ``version`` 0 means every version of the servable.
    """

    kind: Literal["repository.command"] = "repository.command"
    action: Literal["load", "unload"]
    servable: str = Field(min_length=1, max_length=128)
    version: int = Field(default=0, ge=0)


class JobCancel(_Message):
    """Ranks drop a job (waiting collectives included): it already has an outcome."""

    kind: Literal["job.cancel"] = "job.cancel"
    job: str
    servable: str
    version: int
    reason: str


class TensorSpec(BaseModel):
    """Name, KServe datatype and shape (-1 = any size) of a servable input or output.

    The optional bounds let a dynamic-shape model refuse input values it cannot handle
    (e.g. a token id past the vocabulary) before any work reaches the agents.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    datatype: str
    shape: tuple[int, ...]
    min_value: float | None = None  # inclusive lower bound on every element (numeric inputs)
    max_value: float | None = None  # inclusive upper bound on every element (numeric inputs)
    max_shape: tuple[int, ...] | None = None  # per-dimension upper bound, -1 = unbounded

    @model_validator(mode="after")
    def _consistent_bounds(self) -> TensorSpec:
        if self.max_shape is not None and len(self.max_shape) != len(self.shape):
            raise ValueError(
                f"{self.name}: max_shape {list(self.max_shape)} and shape {list(self.shape)} "
                "differ in rank"
            )
        low, high = self.min_value, self.max_value
        if low is not None and high is not None and low > high:
            raise ValueError(f"{self.name}: min_value {low} > max_value {high}")
        return self


class RankStatus(BaseModel):
    """What the scheduler knows of one rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    stage: int
    state: Literal["missing", "loading", "ready", "draining", "lost"]
    heartbeat_age_s: float | None = None
    slice_checksum: str = ""
    cache: str = "off"
    rss_bytes: int = 0
    inflight: int = 0
    host: str = ""
    pid: int = 0
    load_ms: float = 0.0
    jobs_done: int = 0
    compute_ms_total: float = 0.0
    collective_ms_total: float = 0.0
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    sequences: int = 0


class MethodStatus(BaseModel):
    """A method of a servable and its signature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


class ServableStatus(BaseModel):
    """One version of one servable as the scheduler sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    ready: bool
    reason: str = ""
    rank_size: int
    stage_size: int
    with_batch_dim: bool = False
    max_batch_size: int = 0
    methods: tuple[MethodStatus, ...]
    ranks: tuple[RankStatus, ...]
    inflight: int = 0
    queued: int = 0
    requests_total: int = 0
    errors_total: int = 0
    batches_total: int = 0
    batched_instances_total: int = 0
    state: Literal["loading", "available", "unloading", "failed"] = "available"
    generation: bool = False  # a text-generation servable (OpenAI / generate routes)
    running_sequences: int = 0
    waiting_sequences: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0


class MeshStatus(_Message):
    """The scheduler's periodic view of every servable, for gateways and `shardserve status`."""

    kind: Literal["mesh.status"] = "mesh.status"
    scheduler: str
    time: float
    servables: tuple[ServableStatus, ...]
    dead_lettered: int = 0
    request_queue_depth: int = 0


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
