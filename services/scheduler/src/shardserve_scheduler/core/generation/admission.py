"""Admission of sequences to one servable version: whole-length KV reservation.

A sequence reserves ``capacity`` = prompt + max_tokens tokens (capped by the model's
context) on every rank of the group when it is admitted, and never more later: a running
sequence never runs out of KV. Every rank holds the same sequences, so the group's room is
the smallest rank's budget in tokens (its ``kv_capacity_bytes // kv_bytes_per_token``, from
its hello and heartbeats) minus what running sequences reserved.

Decisions: a sequence that cannot fit even in an empty cache (or whose prompt fills the
context) is refused 400, naming the limit; one that does not fit now (or finds
``max_running`` sequences running, or others already waiting: FIFO) waits in a bounded
queue; a full queue refuses it 503 with ``retry_after_s``. A rank that reports no KV budget
(``kv_bytes_per_token`` 0: an agent that does not say) sets no limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardserve_scheduler.core.generation.sequences import Sequence
from shardserve_scheduler.core.registry import GroupState

RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class KvLimit:
    """The smallest rank's whole KV budget, in tokens."""

    tokens: int
    rank: int
    capacity_bytes: int
    bytes_per_token: int

    def describe(self) -> str:
        return (
            f"rank {self.rank} holds at most {self.tokens} tokens of KV cache "
            f"({self.capacity_bytes} bytes at {self.bytes_per_token} bytes per token)"
        )


def kv_limit(group: GroupState) -> KvLimit | None:
    """The tightest rank's budget; None when no rank reports one."""
    limits = [
        KvLimit(
            slot.kv_capacity_bytes // slot.kv_bytes_per_token,
            slot.rank,
            slot.kv_capacity_bytes,
            slot.kv_bytes_per_token,
        )
        for slot in group.slots
        if slot.kv_bytes_per_token > 0
    ]
    return min(limits, key=lambda limit: (limit.tokens, limit.rank), default=None)


def never_fits(prompt_len: int, capacity: int, max_positions: int, limit: KvLimit | None) -> str:
    """Why a sequence can never run ('' when it can)."""
    if prompt_len >= max_positions:
        return (
            f"the prompt has {prompt_len} tokens; the model's context is {max_positions} "
            "tokens, which leaves no room to generate"
        )
    if limit is not None and capacity > limit.tokens:
        return (
            f"the request needs {capacity} tokens of KV cache (prompt {prompt_len} + "
            f"max_tokens, capped by the context of {max_positions}); {limit.describe()}"
        )
    return ""


@dataclass
class Admission:
    """Reserved tokens, running count and waiting queue of one version."""

    max_running: int
    max_waiting: int
    reserved_tokens: int = 0
    waiting: deque[Sequence] = field(default_factory=deque)
    held: dict[int, Sequence] = field(default_factory=dict)  # started, not yet released

    def fits_now(self, capacity: int, limit: KvLimit | None) -> bool:
        if self.running >= self.max_running:
            return False
        return limit is None or self.reserved_tokens + capacity <= limit.tokens

    def can_start(self, sequence: Sequence, limit: KvLimit | None) -> bool:
        """Whether a new sequence starts now (nobody waits before it and it fits)."""
        return not self.waiting and self.fits_now(sequence.capacity, limit)

    @property
    def queue_full(self) -> bool:
        return len(self.waiting) >= self.max_waiting

    @property
    def running(self) -> int:
        return len(self.held)

    def start(self, sequence: Sequence) -> None:
        self.reserved_tokens += sequence.capacity
        self.held[sequence.id] = sequence
        sequence.status = "running"

    def release(self, sequence: Sequence) -> None:
        """A started sequence's reservation is free again (its free reached every rank, or
        no rank ever reserved it); releasing twice is harmless."""
        if self.held.pop(sequence.id, None) is not None:
            self.reserved_tokens -= sequence.capacity

    def clear(self) -> list[Sequence]:
        """Forget every reservation and waiting sequence (the group lost a rank); return the
        waiting ones."""
        waiting = list(self.waiting)
        self.waiting.clear()
        self.held.clear()
        self.reserved_tokens = 0
        return waiting

    def next_waiting(self, limit: KvLimit | None) -> Sequence | None:
        """The head of the queue if it fits now (FIFO: nobody overtakes it)."""
        if self.waiting and self.fits_now(self.waiting[0].capacity, limit):
            return self.waiting.popleft()
        return None
