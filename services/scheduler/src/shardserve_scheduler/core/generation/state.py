"""What the generation machine keeps: versions, open sequences, steps in flight, ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve_scheduler.core.generation.lanes import VersionRun
from shardserve_scheduler.core.generation.sequences import Sequence, VersionKey
from shardserve_scheduler.core.generation.steps import Step


@dataclass(frozen=True)
class Limits:
    max_running: int = 64  # sequences per version holding KV
    max_waiting: int = 256  # sequences per version waiting for KV room
    max_prefill_tokens: int = 512  # prompt tokens per step
    step_timeout: float = 30.0  # seconds for a step through every stage
    max_decode_steps: int = 8  # decode steps per StepWork at most (decode_runs)
    decode_run_ms: float = 200.0  # a decode run's wall time at most, about (decode_runs)


@dataclass
class GenerationCounters:
    late_results: int = 0
    duplicate_results: int = 0
    stray_results: int = 0


@dataclass
class GenerationState:
    result_to: str
    id_prefix: str
    limits: Limits
    versions: dict[VersionKey, VersionRun] = field(default_factory=dict)
    sequences: dict[int, Sequence] = field(default_factory=dict)  # open: waiting or running
    streams: dict[tuple[str, str], int] = field(default_factory=dict)  # (reply_to, corr) -> id
    steps: dict[str, Step] = field(default_factory=dict)
    counters: GenerationCounters = field(default_factory=GenerationCounters)
    _next_sequence: int = 0
    _next_step: int = 0

    def sequence_id(self) -> int:
        self._next_sequence += 1
        return self._next_sequence

    def step_id(self) -> str:
        self._next_step += 1
        return f"{self.id_prefix}-g{self._next_step}"

    def open(self, sequence: Sequence) -> None:
        self.sequences[sequence.id] = sequence
        self.streams[sequence.origin.stream_key] = sequence.id

    def close(self, sequence: Sequence) -> None:
        sequence.status = "done"
        self.sequences.pop(sequence.id, None)
        self.streams.pop(sequence.origin.stream_key, None)
