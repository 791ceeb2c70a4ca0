"""Control-plane messages (exchange shardserve.control): agents' hello, heartbeat and bye,
verdicts, the scheduler's hello and mesh status, job cancels, repository commands."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardserve.wire.message import _Message

# ---------------------------------------------------------------- control plane


class RankReport(BaseModel):
    """What an agent reports of its rank's process and work, in its hello and every
    heartbeat; the scheduler relays it in the mesh status (``RankStatus``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = ""
    pid: int = 0
    load_ms: float = 0.0
    rss_bytes: int = 0
    inflight: int = 0
    jobs_done: int = 0
    compute_ms_total: float = 0.0
    collective_ms_total: float = 0.0
    # generation servables: the rank's KV cache budget and use, its open sequences
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    sequences: int = 0


class _AgentState(_Message, RankReport):
    instance: str
    servable: str
    version: int
    rank: int
    stage: int
    slice_checksum: str
    state: Literal["loading", "ready", "draining"] = "ready"
    cache: Literal["hit", "miss", "off"] = "off"
    control_key: str = ""
    kv_bytes_per_token: int = 0  # generation servables: the KV cache cost of one token


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


MAX_SERVABLE_NAME = 128  # characters of a servable name in a RepositoryCommand


class RepositoryCommand(_Message):
    """Load (bring up) or unload (drain, then drop) one servable version without a restart.

    Sent by a gateway (model repository extension) or an operator to key
    ``scheduler.command``; ``version`` 0 means every version of the servable.
    """

    kind: Literal["repository.command"] = "repository.command"
    action: Literal["load", "unload"]
    servable: str = Field(min_length=1, max_length=MAX_SERVABLE_NAME)
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


class RankStatus(RankReport):
    """What the scheduler knows of one rank: its place and state, and the agent's latest
    report."""

    rank: int
    stage: int
    state: Literal["missing", "loading", "ready", "draining", "lost"]
    heartbeat_age_s: float | None = None
    slice_checksum: str = ""
    cache: str = "off"


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
    # A text prompt of more UTF-8 bytes surely has no room in the context (its tokenizer
    # bounds the bytes a token stands for: shardserve.text.token_bound); None: no bound.
    # Gateways refuse such prompts before publishing, as the scheduler would.
    prompt_bytes_limit: int | None = None
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
