"""Generation steps: one step packs the tokens of a lane's sequences for the whole pipeline.

Building (``build_step``): each running sequence contributes its next prompt chunk (prefill:
at most ``max_prefill_tokens`` prompt tokens per step, shared in lane order) or, once its
prompt is in, its last generated token (decode). A sequence whose prompt is complete after
this step gets a logit row, and so one sampled token. The step also carries the KV
reservations of sequences it is the first to mention and the ids to free first.

Agreement (as for jobs, ``jobs.stage_answered``): a stage is complete when every rank of it
answered (the leader alone where the stage's outputs are combined at the leader); all their
digests must be equal. The leader's outputs are the next stage's inputs; the last stage's
leader returns the tokens.

A decode run (``decode_steps`` K > 1, ``decode_runs``) is one Step of K iterations: the
leader's results of iterations 0..K-2 stream their tokens (``Step.streams``); every rank
answers the last, and only those answers complete the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardserve.repo.repository import GroupConfig
from shardserve.wire.protocol import (
    RowSampling,
    SequenceReservation,
    SequenceSpan,
    StepResult,
    StepWork,
    TensorMap,
)
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve_scheduler.core.generation.sequences import Sequence


@dataclass
class Step:
    """One step of one lane, from stage 0 to the last stage."""

    id: str
    group: GroupConfig
    lane: int
    members: tuple[Sequence, ...]  # sequences with rows in it
    sampled: tuple[Sequence, ...]  # sequences with a logit row, in row order
    freed: tuple[Sequence, ...]  # sequences whose KV the step frees first
    spans: tuple[SequenceSpan, ...]
    reserve: tuple[SequenceReservation, ...]
    sampling: tuple[RowSampling, ...]
    inputs: TensorMap
    deadline: float  # step timeout: every stage must be done by then
    stage: int = 0
    results: dict[int, StepResult] = field(default_factory=dict)  # this stage's, by rank
    decode_steps: int = 1  # K > 1: a decode run (decode_runs)
    decode_only: bool = False  # every row a decode row: its iterations are timed
    streamed: int = 0  # iterations of a decode run whose tokens are in (the last excepted)
    marked_at: float = 0.0  # when it was published, or its last iteration's tokens came

    @property
    def label(self) -> str:
        return f"step {self.id} of {self.group.servable} v{self.group.version}"

    def stage_ranks(self) -> tuple[int, ...]:
        return self.group.stages[self.stage].ranks

    def silent_ranks(self) -> list[int]:
        return [r for r in self.stage_ranks() if r not in self.results]

    @property
    def last_stage(self) -> bool:
        return self.stage == self.group.stage_size - 1

    def work(self, result_to: str) -> StepWork:
        """The StepWork of the current stage."""
        return StepWork(
            step=self.id,
            servable=self.group.servable,
            version=self.group.version,
            stage=self.stage,
            inputs=self.inputs,
            digest=digest_tensors(self.inputs),
            deadline=self.deadline,
            result_to=result_to,
            layout=self.spans,
            reserve=self.reserve,
            free=tuple(s.id for s in self.freed),
            sampling=self.sampling,
            decode_steps=self.decode_steps,
        )

    def streams(self, result: StepResult) -> bool:
        """A decode run's result of an iteration before its last (the leader's tokens)."""
        return result.error is None and result.iteration < self.decode_steps - 1


@dataclass
class _Rows:
    """The packed rows of a step while it is built."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    spans: list[SequenceSpan] = field(default_factory=list)
    members: list[Sequence] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)

    def add(self, sequence: Sequence, start: int, tokens: list[int], sample: bool) -> None:
        self.spans.append(SequenceSpan(seq=sequence.id, start=start, count=len(tokens)))
        self.ids += tokens
        self.positions += range(start, start + len(tokens))
        self.members.append(sequence)
        if sample:
            self.logit_rows.append(len(self.ids) - 1)
            self.sampled.append(sequence)

    def inputs(self) -> TensorMap:
        def int64(values: list[int]) -> Tensor:
            return Tensor.from_numpy(np.asarray(values, np.int64))

        return {
            "input_ids": int64(self.ids),
            "positions": int64(self.positions),
            "logit_rows": int64(self.logit_rows),
        }


def pack_rows(sequences: list[Sequence], max_prefill_tokens: int) -> _Rows:
    """The rows of the lane's next step; advances each sequence's ``prefilled``."""
    rows = _Rows()
    budget = max_prefill_tokens
    for sequence in sequences:
        if sequence.prompt_done:
            rows.add(sequence, sequence.length - 1, sequence.generated[-1:], sample=True)
            continue
        take = min(len(sequence.prompt) - sequence.prefilled, budget)
        if take <= 0:
            continue  # the step's prefill budget is spent: its next chunk goes next step
        start = sequence.prefilled
        sequence.prefilled += take
        budget -= take
        rows.add(sequence, start, list(sequence.prompt[start : start + take]), sequence.prompt_done)
    return rows


def row_sampling(sequence: Sequence) -> RowSampling:
    """The sequence's next row: its first row (decoding) at its next token, with the history
    the penalties read when it has any."""
    first = sequence.decoding.row
    update: dict[str, object] = {"seq": sequence.id, "index": len(sequence.generated)}
    if first.penalized:
        update["output_ids"] = tuple(sequence.generated)
    return first.model_copy(update=update)


def reservations(members: list[Sequence]) -> tuple[SequenceReservation, ...]:
    """Reservations of the members no published step has reserved yet (marked reserved)."""
    new = [s for s in members if not s.reserved_on_ranks]
    for sequence in new:
        sequence.reserved_on_ranks = True
    return tuple(SequenceReservation(seq=s.id, capacity=s.capacity) for s in new)


def stage_answered(step: Step) -> bool:
    """Every rank of the stage answered, or its leader where the outputs are combined there
    (not in a decode run: there every rank holds the outputs and answers)."""
    if len(step.results) == len(step.stage_ranks()):
        return True
    if step.decode_steps > 1:
        return False
    leader_answered = step.group.leader_of(step.stage) in step.results
    return leader_answered and step.group.stages[step.stage].outputs_at_leader


def digest_disagreement(step: Step) -> str:
    """'' when every rank that answered reported the same digest, else who said what."""
    by_digest: dict[str, list[int]] = {}
    for rank in sorted(step.results):
        by_digest.setdefault(step.results[rank].digest, []).append(rank)
    if len(by_digest) <= 1:
        return ""
    parts = [f"ranks {ranks} digest {digest[:12]}..." for digest, ranks in by_digest.items()]
    return f"ranks disagree on stage {step.stage} of {step.label}: {', '.join(parts)}"


def next_inputs(step: Step, outputs: TensorMap) -> TensorMap:
    """The next stage's inputs from the leader's outputs (by name; all when names differ)."""
    wanted = step.group.stages[step.stage + 1].inputs
    if all(name in outputs for name in wanted):
        return {name: outputs[name] for name in wanted}
    return dict(outputs)
