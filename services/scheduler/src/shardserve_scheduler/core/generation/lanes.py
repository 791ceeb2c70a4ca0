"""The state of one servable version's generation: lanes, admission, counters.

A version runs one lane per pipeline stage (micro-batches): with S stages, S steps can be in
flight at once, each at a different stage, so every stage is busy. A new sequence joins the
lane with the fewest sequences; it enters that lane's next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.repo.repository import GroupConfig
from shardserve.text.tokenizer import TextModel
from shardserve_scheduler.core.generation.admission import Admission
from shardserve_scheduler.core.generation.sequences import Sequence
from shardserve_scheduler.core.generation.steps import Step


@dataclass
class Lane:
    index: int
    sequences: list[Sequence] = field(default_factory=list)
    step: Step | None = None  # the step in flight
    leaving: list[Sequence] = field(default_factory=list)  # left; the next step frees them


@dataclass
class GenerationStats:
    requests_total: int = 0
    errors_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0


@dataclass
class VersionRun:
    group: GroupConfig
    text: TextModel
    admission: Admission
    lanes: list[Lane]
    stats: GenerationStats = field(default_factory=GenerationStats)
    iteration_ms: float | None = None  # recent time of one decode iteration (decode_runs)

    @classmethod
    def build(cls, group: GroupConfig, text: TextModel, admission: Admission) -> VersionRun:
        return cls(group, text, admission, [Lane(i) for i in range(group.stage_size)])

    def emptiest_lane(self) -> Lane:
        return min(self.lanes, key=lambda lane: (len(lane.sequences), lane.index))

    def running_sequences(self) -> list[Sequence]:
        return [s for lane in self.lanes for s in lane.sequences]

    def steps(self) -> list[Step]:
        return [lane.step for lane in self.lanes if lane.step is not None]
