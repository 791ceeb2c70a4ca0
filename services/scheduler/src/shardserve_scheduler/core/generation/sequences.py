"""A sequence: one GenerateRequest as the scheduler advances it, token by token.

Its life: ``waiting`` (queued for KV room) -> ``running`` (in a lane; its prompt goes in
over one or more steps, then one decode token per step) -> ``done`` (finished, failed or
cancelled; its last chunk is sent, its KV cache is freed on the ranks that hold it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardserve.wire.protocol import GenerateRequest, SamplingParams
from shardserve_scheduler.core.generation.decoding import Decoding
from shardserve_scheduler.core.generation.text_stream import TextStream

SequenceStatus = Literal["waiting", "running", "done"]
VersionKey = tuple[str, int]


@dataclass(frozen=True)
class Origin:
    """Where a sequence's chunks go and who asked."""

    request: GenerateRequest
    reply_to: str
    correlation_id: str

    @property
    def stream_key(self) -> tuple[str, str]:
        """What a GenerateCancel names."""
        return (self.reply_to, self.correlation_id)


@dataclass
class Sequence:
    id: int
    origin: Origin
    key: VersionKey
    prompt: tuple[int, ...]
    sampling: SamplingParams  # with a seed (drawn at admission when the request had none)
    decoding: Decoding  # the sampling with the model's defaults: max_tokens and the row
    capacity: int  # tokens reserved on every rank: prompt + max_tokens, capped by the context
    max_positions: int
    text: TextStream
    accepted_at: float
    status: SequenceStatus = "waiting"
    lane: int = -1
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already sent in a published step
    reserved_on_ranks: bool = False  # a published step carried its reservation
    next_chunk: int = 0  # GenerateChunk.seq of the next chunk
    closed: bool = False  # its last chunk is out

    @property
    def request_id(self) -> str:
        return self.origin.request.id

    @property
    def deadline(self) -> float:
        return self.origin.request.deadline

    @property
    def prompt_done(self) -> bool:
        return self.prefilled >= len(self.prompt)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def finish_reason_after_token(self) -> Literal["length"] | None:
        """ "length" once max_tokens are generated or the context is full."""
        if len(self.generated) >= self.decoding.max_tokens or self.length >= self.max_positions:
            return "length"
        return None

    def take_chunk_number(self) -> int:
        number, self.next_chunk = self.next_chunk, self.next_chunk + 1
        return number
