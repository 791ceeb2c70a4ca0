"""Sequences through lanes: start, step, relay, tokens, leave, fail (the machine's engine).

Order of frees and reservations: every stage's StepWork and SequencesFree leave from one
channel in the order produced here. A sequence that leaves while a step holding it is in
flight is freed by its lane's NEXT step (or a SequencesFree when the lane has none), so a
stage never sees the free before the step; its KV budget returns when that free has been
published to the last stage, so no later reservation reaches a rank before the free.
"""

from __future__ import annotations

from collections.abc import Callable

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import (
    JobCancel,
    SequencesFree,
    StepResult,
    TokenLogprob,
    TopLogprob,
)
from shardserve.wire.tensors import digest_mismatch, digest_tensors
from shardserve_scheduler.core.actions import (
    Action,
    Cancel,
    PublishFree,
    PublishStep,
    bug_log,
    bug_message,
)
from shardserve_scheduler.core.generation import chunks
from shardserve_scheduler.core.generation.admission import KvLimit
from shardserve_scheduler.core.generation.decode_runs import decode_steps, record_iteration
from shardserve_scheduler.core.generation.lanes import Lane, VersionRun
from shardserve_scheduler.core.generation.sequences import Sequence
from shardserve_scheduler.core.generation.state import GenerationState
from shardserve_scheduler.core.generation.steps import (
    Step,
    digest_disagreement,
    next_inputs,
    pack_rows,
    reservations,
    row_sampling,
)

# The current KV limit of a version's group (from the registry's rank reports).
LimitOf = Callable[[VersionRun], KvLimit | None]


class Flow:
    def __init__(self, state: GenerationState, limit_of: LimitOf) -> None:
        self._state = state
        self._limit_of = limit_of

    # ------------------------------------------------------------------ admission

    def start(self, run: VersionRun, sequence: Sequence, now: float) -> list[Action]:
        """A sequence takes its KV room and joins a lane (its next step if busy)."""
        run.admission.start(sequence)
        run.stats.prompt_tokens_total += len(sequence.prompt)
        lane = run.emptiest_lane()
        sequence.lane = lane.index
        lane.sequences.append(sequence)
        return self.kick(run, lane, now)

    def admit_waiting(self, run: VersionRun, now: float) -> list[Action]:
        """Start waiting sequences, oldest first, while they fit."""
        actions: list[Action] = []
        limit = self._limit_of(run)
        while (sequence := run.admission.next_waiting(limit)) is not None:
            actions += self.start(run, sequence, now)
        return actions

    def release(self, run: VersionRun, leaving: list[Sequence], now: float) -> list[Action]:
        for sequence in leaving:
            run.admission.release(sequence)
        return self.admit_waiting(run, now) if leaving else []

    # ------------------------------------------------------------------ steps

    def kick(self, run: VersionRun, lane: Lane, now: float) -> list[Action]:
        """An idle lane starts its next step (or, with nothing to run, frees what left)."""
        if lane.step is not None:
            return []
        limits = self._state.limits
        decode_only = all(s.prompt_done for s in lane.sequences)  # before packing moves it
        rows = pack_rows(lane.sequences, limits.max_prefill_tokens)
        freed, lane.leaving = lane.leaving, []
        if not rows.spans:
            return self.free_everywhere(run, freed, now)
        steps = decode_steps(run, rows.members, limits) if decode_only else 1
        step = Step(
            id=self._state.step_id(),
            group=run.group,
            lane=lane.index,
            members=tuple(rows.members),
            sampled=tuple(rows.sampled),
            freed=tuple(freed),
            spans=tuple(rows.spans),
            reserve=reservations(rows.members),
            sampling=tuple(row_sampling(s) for s in rows.sampled),
            inputs=rows.inputs(),
            deadline=now + limits.step_timeout,
            decode_steps=steps,
            decode_only=decode_only,
            marked_at=now,
        )
        self._state.steps[step.id] = step
        lane.step = step
        return self._publish(run, step, now)

    def _publish(self, run: VersionRun, step: Step, now: float) -> list[Action]:
        actions: list[Action] = [PublishStep(step.work(self._state.result_to))]
        if step.last_stage:  # its frees have reached every stage
            actions += self.release(run, list(step.freed), now)
        return actions

    def free_everywhere(self, run: VersionRun, leaving: list[Sequence], now: float) -> list[Action]:
        """SequencesFree to every stage now, then their KV room is free again."""
        return [*free_messages(run, leaving), *self.release(run, leaving, now)]

    def stage_complete(self, run: VersionRun, step: Step, now: float) -> list[Action]:
        """Every rank of the step's stage answered: relay, or take the tokens."""
        disagreement = digest_disagreement(step)
        if disagreement:
            return self.fail_step(run, step, ErrorCode.RANK_MISMATCH, disagreement, now)
        leader = step.group.leader_of(step.stage)
        answer = step.results[leader]
        if step.last_stage:
            return self._tokens(run, step, answer, now)
        where = f"stage {step.stage} leader rank {leader} of {step.label}"
        if answer.outputs is None:
            return self.fail_step(run, step, ErrorCode.INTERNAL, f"{where} sent no outputs", now)
        problem = digest_mismatch(answer.digest, digest_tensors(answer.outputs), "outputs")
        if problem:
            return self.fail_step(run, step, ErrorCode.INTERNAL, f"{where}: {problem}", now)
        step.inputs = next_inputs(step, answer.outputs)
        step.stage += 1
        step.results = {}
        return self._publish(run, step, now)

    def streamed(self, run: VersionRun, step: Step, result: StepResult, now: float) -> list[Action]:
        """An iteration of a decode run before its last: the leader's tokens go out as
        chunks at once; the step goes on (the last iteration's results complete it)."""
        counters = self._state.counters
        if result.rank != step.group.leader_of(step.stage):
            counters.stray_results += 1
            return []
        if result.iteration < step.streamed:
            counters.duplicate_results += 1
            return []
        if result.iteration > step.streamed:
            why = f"{step.label}: iteration {result.iteration} came before {step.streamed}"
            return self.fail_step(run, step, ErrorCode.INTERNAL, why, now)
        problem = self._count_problem(step, result.tokens)
        if problem:
            return self.fail_step(run, step, ErrorCode.INTERNAL, problem, now)
        step.streamed += 1
        self._timed(run, step, now)
        return self._each_token(run, step, result, now)

    def _tokens(self, run: VersionRun, step: Step, answer: StepResult, now: float) -> list[Action]:
        """The step's last tokens: it ends, its sequences take them, the lane goes on."""
        problem = self._count_problem(step, answer.tokens)
        if not problem and step.streamed != step.decode_steps - 1:
            problem = f"{step.label} ended after {step.streamed + 1} of {step.decode_steps} steps"
        if problem:
            return self.fail_step(run, step, ErrorCode.INTERNAL, problem, now)
        self._timed(run, step, now)
        self._retire(run, step)
        chunks = self._each_token(run, step, answer, now)
        # The lane's next step goes out before the chunks: the sender publishes in order,
        # and the ranks then compute while the chunks are published (32 sequences: 32
        # publishes off the step's critical path). The step already leaves out the
        # sequences these tokens finished.
        return self.kick(run, run.lanes[step.lane], now) + chunks

    @staticmethod
    def _count_problem(step: Step, tokens: tuple[int, ...]) -> str:
        if len(tokens) == len(step.sampled):
            return ""
        return f"{step.label}: {len(tokens)} tokens for {len(step.sampled)} logit rows"

    @staticmethod
    def _timed(run: VersionRun, step: Step, now: float) -> None:
        """One iteration's tokens are in: time it (decode-only steps: decode_runs)."""
        if step.decode_only:
            record_iteration(run, (now - step.marked_at) * 1000)
        step.marked_at = now

    def _each_token(
        self, run: VersionRun, step: Step, result: StepResult, now: float
    ) -> list[Action]:
        """Each sampled sequence takes its token; one whose logit row was not finite ends
        with an error instead (the model's numerics broke for it alone)."""
        tokens, logprobs = result.tokens, result.logprobs
        padded = logprobs if len(logprobs) == len(tokens) else (None,) * len(tokens)
        actions: list[Action] = []
        for row, (sequence, token, logprob) in enumerate(
            zip(step.sampled, tokens, padded, strict=True)
        ):
            if row in result.broken_rows:
                actions += self._broken_row(run, sequence, now)
            else:
                actions += self._token_or_end(run, sequence, token, logprob, now)
        return actions

    def _broken_row(self, run: VersionRun, sequence: Sequence, now: float) -> list[Action]:
        """A sequence whose logits were NaN or infinite: it alone ends, with the error."""
        if sequence.status != "running":
            return []  # already ended (an earlier iteration of a decode run)
        message = (
            f"the model's logits for token {len(sequence.generated)} of this sequence were "
            "not finite (NaN or infinity): no token could be sampled"
        )
        run.stats.errors_total += 1
        return [*chunks.error_chunk(sequence, ErrorCode.INTERNAL, message)] + self.leave(
            run, sequence, now
        )

    def _token_or_end(
        self, run: VersionRun, sequence: Sequence, token: int, raw: TokenLogprob | None, now: float
    ) -> list[Action]:
        """``_token``; if it raises (detokenizing, stop strings, a token's text: a bug or
        an input nobody foresaw) that sequence alone ends with the error, the others of
        the step get their tokens."""
        try:
            return self._token(run, sequence, token, raw, now)
        except Exception as exc:
            message = bug_message(f"handling token {token} of {sequence.origin.request.id}", exc)
            run.stats.errors_total += 1
            error = chunks.error_chunk(sequence, ErrorCode.INTERNAL, message)
            return [bug_log(message), *error, *self.leave(run, sequence, now)]

    def _retire(self, run: VersionRun, step: Step) -> None:
        self._state.steps.pop(step.id, None)
        lane = run.lanes[step.lane]
        if lane.step is step:
            lane.step = None

    def _token(
        self, run: VersionRun, sequence: Sequence, token: int, raw: TokenLogprob | None, now: float
    ) -> list[Action]:
        """One sampled token: a chunk, and the end of the sequence when it stops."""
        if sequence.status != "running":
            return []  # cancelled, failed or finished while the step (or run) was in flight
        sequence.generated.append(token)
        run.stats.generated_tokens_total += 1
        logprob = with_texts(run, raw)
        piece = sequence.text.push(token)
        reason = "stop" if piece.stopped else sequence.finish_reason_after_token()
        if reason is None:
            return [chunks.token_chunk(sequence, token, piece.text, logprob)]
        text = piece.text + sequence.text.finish()
        last = chunks.last_chunk(sequence, reason, token, text, logprob)
        return [last, *self.leave(run, sequence, now)]

    # ------------------------------------------------------------------ leaving

    def leave(self, run: VersionRun, sequence: Sequence, now: float) -> list[Action]:
        """A sequence is done (its last chunk is out or going): it leaves its lane at once;
        its KV is freed by the lane's next step, or now when no rank holds it."""
        was_waiting = sequence.status == "waiting"
        self._state.close(sequence)
        if was_waiting:
            if sequence in run.admission.waiting:
                run.admission.waiting.remove(sequence)
            return []
        lane = run.lanes[sequence.lane]
        if sequence in lane.sequences:
            lane.sequences.remove(sequence)
        if not sequence.reserved_on_ranks:
            return self.release(run, [sequence], now)
        lane.leaving.append(sequence)
        return []

    def end(
        self, run: VersionRun, sequence: Sequence, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """A sequence fails (cancel, deadline): its error chunk, it leaves, its lane goes on."""
        run.stats.errors_total += code != ErrorCode.CANCELLED
        actions: list[Action] = [*chunks.error_chunk(sequence, code, message)]
        actions += self.leave(run, sequence, now)
        if sequence.lane >= 0:
            actions += self.kick(run, run.lanes[sequence.lane], now)
        return actions

    def fail_step(
        self, run: VersionRun, step: Step, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """A step failed: its sequences end with the error; every stage frees what the step
        reserved or was to free; the lane's other sequences go on."""
        self._retire(run, step)
        actions: list[Action] = [cancel_step(step, message)]
        for sequence in step.members:
            if sequence.status == "running":
                run.stats.errors_total += 1
                actions += chunks.error_chunk(sequence, code, message)
                actions += self.leave(run, sequence, now)
        lane = run.lanes[step.lane]
        dropped = [*step.freed, *step.members, *lane.leaving]
        lane.leaving = []
        actions += self.free_everywhere(run, list({s.id: s for s in dropped}.values()), now)
        return actions + self.kick(run, lane, now)


def cancel_step(step: Step, reason: str) -> Action:
    """Stop a failed step on every rank of its group: a live rank may be waiting in a
    collective for a rank that is gone, and the frees queued behind the step with it."""
    group = step.group
    return Cancel(
        JobCancel(job=step.id, servable=group.servable, version=group.version, reason=reason)
    )


def free_messages(run: VersionRun, leaving: list[Sequence]) -> list[Action]:
    """One SequencesFree per stage for the sequences some rank holds."""
    held = tuple(sorted({s.id for s in leaving if s.reserved_on_ranks}))
    if not held:
        return []
    group = run.group
    return [
        PublishFree(
            SequencesFree(servable=group.servable, version=group.version, stage=stage, seqs=held)
        )
        for stage in range(group.stage_size)
    ]


def with_texts(run: VersionRun, raw: TokenLogprob | None) -> TokenLogprob | None:
    """The agent sends logprobs without token texts; the tokenizer is here."""
    if raw is None:
        return None
    text = run.text.token_text
    top = tuple(
        TopLogprob(token_id=t.token_id, text=text(t.token_id), logprob=t.logprob) for t in raw.top
    )
    return TokenLogprob(
        token_id=raw.token_id, text=text(raw.token_id), logprob=raw.logprob, top=top
    )
