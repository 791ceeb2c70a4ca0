"""The GenerationMachine: generation events in, actions out (pure; ``now`` is the caller's).

Events: a GenerateRequest resolved to a Target (``on_generate``), a GenerateCancel
(``on_cancel``), a rank's StepResult (``on_step_result``), a group that lost ranks
(``on_rank_lost``), the clock (``on_tick``: request deadlines and step timeouts), the
scheduler stopping (``shutdown``). Actions: PublishStep, PublishFree, SendChunk, Log.

Every stream ends with exactly one last chunk: a finish reason with usage, or an error
(CANCELLED, DEADLINE, RANK_LOST, a step's failure, a refusal).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from shardserve.errors import ErrorCode, InferenceError
from shardserve.wire.protocol import StepResult
from shardserve_scheduler.core.actions import Action, Log, bug_log, bug_message
from shardserve_scheduler.core.generation import chunks
from shardserve_scheduler.core.generation.admission import (
    RETRY_AFTER_S,
    Admission,
    KvLimit,
    kv_limit,
    never_fits,
)
from shardserve_scheduler.core.generation.decoding import decoding
from shardserve_scheduler.core.generation.flow import Flow, cancel_step, free_messages
from shardserve_scheduler.core.generation.lanes import GenerationStats, VersionRun
from shardserve_scheduler.core.generation.resolve import Target
from shardserve_scheduler.core.generation.sequences import Origin, Sequence
from shardserve_scheduler.core.generation.state import GenerationState, Limits
from shardserve_scheduler.core.generation.steps import Step, stage_answered
from shardserve_scheduler.core.generation.text_stream import TextStream
from shardserve_scheduler.core.registry import Registry

SEED_BOUND = 2**63


class GenerationMachine:
    def __init__(
        self,
        registry: Registry,
        *,
        result_to: str,
        id_prefix: str,
        limits: Limits | None = None,
        seeds: Callable[[], int] | None = None,
    ) -> None:
        self.registry = registry
        self.state = GenerationState(result_to, id_prefix, limits or Limits())
        self.flow = Flow(self.state, self._limit)
        self._seeds = seeds or (lambda: random.randrange(SEED_BOUND))

    # ------------------------------------------------------------------ events

    def refuse(self, origin: Origin, error: InferenceError) -> list[Action]:
        """A request resolution refused: its whole stream is one error chunk."""
        if self.is_live(origin):
            return [_duplicate_log(origin)]
        return [chunks.refusal_chunk(origin, error.code, error.message)]

    def on_generate(self, origin: Origin, target: Target, now: float) -> list[Action]:
        if self.is_live(origin):
            return [_duplicate_log(origin)]
        run = self._run(target)
        run.stats.requests_total += 1
        try:
            sequence = self._sequence(origin, target, now)
        except InferenceError as error:
            run.stats.errors_total += 1
            return self.refuse(origin, error)
        problem = never_fits(
            len(sequence.prompt), sequence.capacity, target.max_positions, self._limit(run)
        )
        if problem:
            run.stats.errors_total += 1
            return [chunks.refusal_chunk(origin, ErrorCode.BAD_INPUT, problem)]
        if run.admission.can_start(sequence, self._limit(run)):
            self.state.open(sequence)
            return self.flow.start(run, sequence, now)
        if run.admission.queue_full:
            run.stats.errors_total += 1
            return [self._overloaded(origin, run)]
        self.state.open(sequence)
        run.admission.waiting.append(sequence)
        return []

    def is_live(self, origin: Origin) -> bool:
        """A generation with ``origin``'s reply_to and correlation_id is running."""
        return origin.stream_key in self.state.streams

    def on_cancel(self, reply_to: str, correlation_id: str, now: float) -> list[Action]:
        message = "the generation was cancelled by its caller"
        return self._end_stream(reply_to, correlation_id, message, now)

    def on_stream_gone(
        self, reply_to: str, correlation_id: str, why: str, now: float
    ) -> list[Action]:
        """A chunk could not be delivered (its reply queue is gone): the sequence ends."""
        message = f"the generation's stream cannot be delivered: {why}"
        return self._end_stream(reply_to, correlation_id, message, now)

    def _end_stream(
        self, reply_to: str, correlation_id: str, message: str, now: float
    ) -> list[Action]:
        sequence = self._by_stream(reply_to, correlation_id)
        if sequence is None:
            return [Log(logging.DEBUG, f"{message}: no such generation {correlation_id}")]
        run = self.state.versions[sequence.key]
        return self.flow.end(run, sequence, ErrorCode.CANCELLED, message, now)

    def on_step_result(self, result: StepResult, now: float) -> list[Action]:
        """A rank's result: a decode run's streamed iteration, or its (or a step's)
        stage outcome, complete when every rank that answers has (``stage_answered``)."""
        step = self._record(result)
        if step is None:
            return []
        run = self.state.versions[(step.group.servable, step.group.version)]
        try:
            if step.streams(result):
                return self.flow.streamed(run, step, result, now)
            if result.error is not None:
                code, message = _rank_error(step, result)
                return self.flow.fail_step(run, step, code, message, now)
            if not stage_answered(step):
                return []
            return self.flow.stage_complete(run, step, now)
        except Exception as exc:  # a scheduler bug: the step's sequences fail loudly
            message = bug_message(f"handling a result of {step.label}", exc)
            return [
                bug_log(message),
                *self.flow.fail_step(run, step, ErrorCode.INTERNAL, message, now),
            ]

    def on_publish_failed(self, step_id: str, message: str, now: float) -> list[Action]:
        """A step's StepWork could not be published (broker trouble): its sequences fail."""
        step = self.state.steps.get(step_id)
        if step is None:
            return []
        run = self.state.versions[(step.group.servable, step.group.version)]
        why = f"could not publish {step.label}: {message}"
        return self.flow.fail_step(run, step, ErrorCode.UNAVAILABLE, why, now)

    def owns_step(self, step_id: str) -> bool:
        return step_id in self.state.steps

    def on_rank_lost(self, servable: str, version: int, message: str, now: float) -> list[Action]:
        """Every sequence of the group ends with RANK_LOST; live ranks free their caches."""
        run = self.state.versions.get((servable, version))
        if run is None:
            return []
        return self._fail_version(run, ErrorCode.RANK_LOST, message, now)

    def on_tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for step in [s for s in self.state.steps.values() if s.deadline <= now]:
            run = self.state.versions[(step.group.servable, step.group.version)]
            actions += self.flow.fail_step(
                run, step, ErrorCode.STAGE_FAILED, _timeout_message(step, self.state.limits), now
            )
        for sequence in [s for s in self.state.sequences.values() if s.deadline <= now]:
            run = self.state.versions[sequence.key]
            message = (
                f"deadline passed after {len(sequence.generated)} generated tokens "
                f"of request {sequence.request_id}"
            )
            actions += self.flow.end(run, sequence, ErrorCode.DEADLINE, message, now)
        return actions

    def shutdown(self, message: str, now: float) -> list[Action]:
        """The scheduler stops serving: every open stream ends UNAVAILABLE."""
        actions: list[Action] = []
        for run in list(self.state.versions.values()):
            actions += self._fail_version(run, ErrorCode.UNAVAILABLE, message, now)
        return actions

    # ------------------------------------------------------------------ queries

    @property
    def open_sequences(self) -> int:
        return len(self.state.sequences)

    def next_wakeup(self) -> float | None:
        times = [s.deadline for s in self.state.sequences.values()]
        times += [s.deadline for s in self.state.steps.values()]
        return min(times, default=None)

    def running(self, servable: str, version: int) -> int:
        run = self.state.versions.get((servable, version))
        return len(run.running_sequences()) if run else 0

    def waiting(self, servable: str, version: int) -> int:
        run = self.state.versions.get((servable, version))
        return len(run.admission.waiting) if run else 0

    def stats(self, servable: str, version: int) -> GenerationStats:
        run = self.state.versions.get((servable, version))
        return run.stats if run else GenerationStats()

    def forget(self, servable: str, version: int) -> None:
        """An unloaded version (no open sequence left)."""
        self.state.versions.pop((servable, version), None)

    # ------------------------------------------------------------------ parts

    def _run(self, target: Target) -> VersionRun:
        key = (target.group.servable, target.group.version)
        run = self.state.versions.get(key)
        if run is None:
            limits = self.state.limits
            admission = Admission(limits.max_running, limits.max_waiting)
            run = VersionRun.build(target.group, target.text, admission)
            self.state.versions[key] = run
        return run

    def _limit(self, run: VersionRun) -> KvLimit | None:
        group = self.registry.group(run.group.servable, run.group.version)
        return kv_limit(group) if group is not None else None

    def _sequence(self, origin: Origin, target: Target, now: float) -> Sequence:
        """The request's sequence; BadInputError when its sampling cannot run (decoding)."""
        sampling = origin.request.sampling
        if sampling.seed is None:  # drawn now, so the sequence is reproducible from its record
            sampling = sampling.model_copy(update={"seed": self._seeds()})
        text = target.text
        stop_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= frozenset(text.eos_token_ids)
        prompt = target.prompt
        plan = decoding(sampling, text, prompt, target.max_positions)
        return Sequence(
            id=self.state.sequence_id(),
            origin=origin,
            key=(target.group.servable, target.group.version),
            prompt=prompt,
            sampling=sampling,
            decoding=plan,
            capacity=min(len(prompt) + plan.max_tokens, target.max_positions),
            max_positions=target.max_positions,
            text=TextStream(text.detokenizer(), sampling.stop, stop_ids),
            accepted_at=now,
        )

    def _overloaded(self, origin: Origin, run: VersionRun) -> Action:
        group = run.group
        message = (
            f"{group.servable} v{group.version}: {len(run.admission.waiting)} sequences already "
            "wait for KV cache room (the --max-waiting-sequences limit); retry later"
        )
        return chunks.refusal_chunk(origin, ErrorCode.OVERLOADED, message, RETRY_AFTER_S)

    def _by_stream(self, reply_to: str, correlation_id: str) -> Sequence | None:
        seq_id = self.state.streams.get((reply_to, correlation_id))
        return None if seq_id is None else self.state.sequences.get(seq_id)

    def _record(self, result: StepResult) -> Step | None:
        step = self.state.steps.get(result.step)
        counters = self.state.counters
        if step is None or result.stage != step.stage:
            counters.late_results += 1
            return None
        if result.rank not in step.stage_ranks():
            counters.stray_results += 1
            return None
        if step.streams(result):
            return step  # not an outcome of the stage: Flow.streamed checks it
        if result.error is None and result.iteration != step.decode_steps - 1:
            counters.stray_results += 1  # an iteration the step does not have
            return None
        if result.rank in step.results:
            counters.duplicate_results += 1
            return None
        step.results[result.rank] = result
        return step

    def _fail_version(
        self, run: VersionRun, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Every open sequence of a version fails; ranks free all they hold."""
        steps = run.steps()
        for step in steps:
            self.state.steps.pop(step.id, None)
        held = [s for lane in run.lanes for s in (*lane.sequences, *lane.leaving)]
        held += [s for step in steps for s in step.freed]
        actions: list[Action] = [cancel_step(step, message) for step in steps]
        for sequence in [*run.admission.clear(), *run.running_sequences()]:
            run.stats.errors_total += 1
            actions += chunks.error_chunk(sequence, code, message)
            self.state.close(sequence)
        for lane in run.lanes:
            lane.sequences, lane.leaving, lane.step = [], [], None
        return actions + free_messages(run, list({s.id: s for s in held}.values()))


def _rank_error(step: Step, result: StepResult) -> tuple[ErrorCode, str]:
    error = result.error
    assert error is not None
    passed = {
        ErrorCode.INTERNAL,
        ErrorCode.DEADLINE,
        ErrorCode.RANK_MISMATCH,
        ErrorCode.OVERLOADED,
        ErrorCode.UNAVAILABLE,
    }
    code = error.code if error.code in passed else ErrorCode.STAGE_FAILED
    return code, f"rank {result.rank} failed stage {step.stage} of {step.label}: {error.message}"


def _timeout_message(step: Step, limits: Limits) -> str:
    silent = ", ".join(str(r) for r in step.silent_ranks()) or "none"
    return (
        f"{step.label} took longer than {limits.step_timeout:g} s at stage {step.stage} "
        f"(ranks not answered: {silent})"
    )


def _duplicate_log(origin: Origin) -> Log:
    """A request reusing a live stream's reply_to and correlation_id is refused without an
    answer: any chunk sent for it would land in that live stream (its owner's)."""
    return Log(
        logging.WARNING,
        f"refused generation {origin.request.id}: correlation_id {origin.correlation_id} "
        f"on {origin.reply_to} belongs to a running generation (not answered: an answer "
        "would land in that stream)",
        origin.request.id,
    )
