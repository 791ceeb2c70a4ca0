"""Generation steps on one rank: StepWork over the rank's KV cache, SequencesFree.

A step, in its turn on the work queue: free ``free``, check it (addressed here, in time,
inputs intact), reserve ``reserve``, check every sequence of its layout is held here, then
run the stage program with a ``StepAttention`` over the cache and the step's collective.
Every rank reports the digest of its outputs; the leader of a middle stage ships them;
the LAST stage's leader samples one token per logit row (``sample_rows``) and returns the
tokens instead of the logits (``outputs`` None).

A step that fails frees its sequences on this rank before it reports: its attention ops
may have written some layers' K/V and not others, and a retry reading that block would
compute garbage without noticing. The scheduler ends those sequences on the error.
An agent that restarted holds no sequences: a step naming one it never reserved fails
clearly instead of attending over nothing.

A decode run (``StepWork.decode_steps`` K > 1, one-stage groups only) is one job of K
iterations (``decode_run``): each feeds back the tokens the last one sampled. The stage
runs with its outputs on every rank (the logits are the same bits everywhere) and every
rank samples, so no rank waits for a token from another. The leader reports each
iteration but the last as it goes (the caller streams it); after the last, every rank
reports the digest of all K iterations' tokens. A cancel (``JobCancel`` of the step) is
seen between iterations (or ends a collective wait): the run stops there, sends nothing
and frees its sequences, as a cancelled single step does. A failure at any iteration is
the step's failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from shardserve.amqp.collective import CollectiveHub, JobCancelledError, JobCollective
from shardserve.errors import DeadlineError, ErrorCode, InferenceError, OverloadedError
from shardserve.runtime.attention import StepAttention, StepLayout
from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.program import Env, run_stage
from shardserve.runtime.sampling import sample_rows
from shardserve.wire.protocol import RowSampling, SequencesFree, StepResult, StepWork
from shardserve_agent.generation.decode_runs import (
    Iteration,
    OffsetCollective,
    collectives_per_run,
    tokens_digest,
)
from shardserve_agent.results import Sampled, StepOutcome, Timing, step_done, step_failed
from shardserve_agent.slice_loader import LoadedSlice
from shardserve_agent.work_checks import (
    OFF_LOOP_BYTES,
    describe_failure,
    digest_problem,
    finished,
    identity_problem,
)

_logger = logging.getLogger(__name__)

LOGITS = "logits"  # the last stage's output (the HF exporter's name)
Account = Callable[[int, float, float], float]  # (stage, started, wait ms) -> compute ms
Clock = Callable[[], float]
Publish = Callable[[str, StepResult], Awaitable[None]]  # (result_to, result)


class StepFailedError(Exception):
    """A step's outcome is this error (code and message as sent)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _no_publish(result_to: str, result: StepResult) -> None:
    raise RuntimeError("this Stepper was built without a way to publish results")


class Stepper:
    """Runs this rank's share of each StepWork; frees sequences."""

    def __init__(
        self,
        loaded: LoadedSlice,
        hub: CollectiveHub,
        cache: KVCache | None,
        account: Account,
        clock: Clock = time.time,
        publish: Publish = _no_publish,
    ) -> None:
        self._slice = loaded
        self._hub = hub
        self.cache = cache
        self._account = account
        self._clock = clock
        self._publish = publish  # a decode run's results before its last (see module doc)
        group = loaded.group
        self._last_stage = loaded.stage.index == group.stage_size - 1

    def free(self, message: SequencesFree) -> None:
        """Free the sequences (ids this rank does not hold are ignored)."""
        group = self._slice.group
        addressed = (message.servable, message.version, message.stage)
        if addressed != (group.servable, group.version, self._slice.stage.index):
            _logger.warning("dropping a free of %s v%d stage %d: not served here", *addressed)
            return
        if self.cache is not None:
            for seq in message.seqs:
                self.cache.free(seq)

    def free_all(self) -> int:
        """Free every sequence held here; how many there were."""
        if self.cache is None:
            return 0
        held = self.cache.sequences()
        for seq in held:
            self.cache.free(seq)
        return len(held)

    async def outcome(self, work: StepWork, draining: bool) -> StepResult | None:
        """The result to send; None for a cancelled step or a non-leader whose stage
        outputs were combined at the leader."""
        problem = identity_problem(
            self._slice, work.servable, work.version, work.stage, work.inputs
        )
        if problem is not None or self.cache is None:
            self._hub.finish(work.step)
            return self._error(work, ErrorCode.INTERNAL, problem or self._not_generation())
        for seq in work.free:
            self.cache.free(seq)
        try:
            return await self._attempt(work, self.cache, draining)
        except StepFailedError as exc:
            self._forget(work, self.cache)
            return self._error(work, exc.code, exc.message)

    def _not_generation(self) -> str:
        group = self._slice.group
        return (
            f"rank {self._slice.rank}: {group.servable} v{group.version} has no attention "
            "ops, so it serves no generation steps"
        )

    async def _attempt(self, work: StepWork, cache: KVCache, draining: bool) -> StepResult | None:
        if self._hub.is_finished(work.step):
            _logger.info("step %s was cancelled before it started here; skipping", work.step)
            self._forget(work, cache)
            return None
        try:
            await self._check(work, draining)
            self._reserve(work, cache)
            self._check_held(work, cache)
        except StepFailedError:
            self._hub.finish(work.step)
            raise
        return await self._run(work, cache)

    async def _check(self, work: StepWork, draining: bool) -> None:
        rank = self._slice.rank
        if draining:
            raise StepFailedError(ErrorCode.UNAVAILABLE, f"rank {rank} is shutting down")
        if work.decode_steps > 1 and self._slice.group.stage_size != 1:
            raise StepFailedError(
                ErrorCode.INTERNAL,
                f"rank {rank}: a run of {work.decode_steps} decode steps needs a group of "
                f"one stage, not {self._slice.group.stage_size}",
            )
        if work.deadline <= self._clock():
            _logger.warning("step %s reached its deadline before it started; dropped", work.step)
            raise StepFailedError(
                ErrorCode.DEADLINE, f"rank {rank}: deadline passed before the step started"
            )
        problem = await digest_problem(rank, work.inputs, work.digest)
        if problem is not None:
            raise StepFailedError(ErrorCode.INTERNAL, problem)

    def _reserve(self, work: StepWork, cache: KVCache) -> None:
        try:
            for reservation in work.reserve:
                cache.reserve(reservation.seq, reservation.capacity)
        except OverloadedError as exc:
            # Admission is the scheduler's: it should never send a reservation that does
            # not fit, so this is a bug (or a budget changed under it) worth a warning.
            message = f"rank {self._slice.rank}: {exc.message}"
            _logger.warning("step %s: %s", work.step, message)
            raise StepFailedError(ErrorCode.OVERLOADED, message) from exc
        except InferenceError as exc:
            raise StepFailedError(exc.code, f"rank {self._slice.rank}: {exc.message}") from exc
        except MemoryError as exc:  # the budget fits, the process cap did not
            message = f"rank {self._slice.rank}: out of memory reserving the KV cache"
            raise StepFailedError(ErrorCode.OVERLOADED, message) from exc

    def _check_held(self, work: StepWork, cache: KVCache) -> None:
        for span in work.layout:
            if span.seq not in cache:
                raise StepFailedError(
                    ErrorCode.INTERNAL,
                    f"rank {self._slice.rank} holds no KV cache for sequence {span.seq} "
                    "(agent restarted?)",
                )

    async def _run(self, work: StepWork, cache: KVCache) -> StepResult | None:
        collective = self._hub.begin(work.step, work.deadline)
        started = time.perf_counter()
        compute = self._decode_run if work.decode_steps > 1 else self._single
        try:
            outcome = await compute(work, cache, collective)
        except JobCancelledError as exc:
            _logger.info("%s", exc)
            self._forget(work, cache)
            return None
        except StepFailedError:
            raise
        except InferenceError as exc:
            _logger.warning("step %s failed: %s", work.step, exc.message)
            raise StepFailedError(exc.code, exc.message) from exc
        except Exception as exc:  # a failing model or a broken peer part: report, keep serving
            _logger.exception("step %s failed on rank %d", work.step, self._slice.rank)
            raise StepFailedError(
                ErrorCode.INTERNAL, describe_failure(self._slice.rank, exc)
            ) from exc
        finally:
            self._hub.finish(work.step)
        compute_ms = self._account(work.stage, started, collective.wait_ms)
        if not outcome.answers:
            return None
        return self._result(work, outcome, Timing(compute_ms, collective.wait_ms))

    async def _single(
        self, work: StepWork, cache: KVCache, collective: JobCollective
    ) -> StepOutcome:
        """One pass of the stage over the step's rows."""
        outputs = await self._computed(work, cache, collective)
        tensors, digest = await finished(outputs)
        sampled = await self._sampled(work, outputs)
        ships = self._slice.is_leader and not self._last_stage
        answers = bool(outputs) or not self._slice.stage.outputs
        return StepOutcome(digest, sampled, tensors if ships else None, answers=answers)

    async def _decode_run(
        self, work: StepWork, cache: KVCache, collective: JobCollective
    ) -> StepOutcome:
        """``work.decode_steps`` passes, each over the tokens the last one sampled."""
        leader = self._slice.is_leader
        iteration = Iteration.first(work, self._slice.stage.inputs, logprobs=leader)
        per_run = collectives_per_run(self._slice.stage)
        tokens: list[tuple[int, ...]] = []
        while True:
            offset = OffsetCollective(collective, iteration.index * per_run)
            outputs = await run_stage(
                self._slice.stage,
                self._slice.runners,
                iteration.inputs,
                offset,
                attention=StepAttention(cache, iteration.layout),
                pieces=self._slice.pieces,
            )
            sampled = await self._sample(outputs, iteration.sampling)
            tokens.append(sampled.tokens)
            if iteration.index == work.decode_steps - 1:
                break
            await self._report(work, iteration.index, sampled)
            await self._between_iterations(work)
            iteration = iteration.next(sampled.tokens)
        return StepOutcome(
            tokens_digest(tokens), sampled if leader else Sampled(), iteration=iteration.index
        )

    async def _report(self, work: StepWork, index: int, sampled: Sampled) -> None:
        """The leader streams an iteration's tokens before the run ends (not the last)."""
        if not self._slice.is_leader:
            return
        outcome = StepOutcome("", sampled, iteration=index)
        await self._publish(work.result_to, self._result(work, outcome, Timing()))

    async def _between_iterations(self, work: StepWork) -> None:
        """Stop a run that was cancelled or is out of time before its next iteration."""
        await asyncio.sleep(0)  # let a JobCancel that came during the iteration be handled
        if self._hub.is_finished(work.step):
            raise JobCancelledError(f"step {work.step} cancelled between decode iterations")
        if work.deadline <= self._clock():
            raise DeadlineError(
                f"rank {self._slice.rank}: step {work.step} reached its deadline between "
                "decode iterations"
            )

    def _result(self, work: StepWork, outcome: StepOutcome, timing: Timing) -> StepResult:
        return step_done(work, self._slice.rank, outcome, timing, self._kv_used())

    def _kv_used(self) -> int:
        return self.cache.used_bytes if self.cache else 0

    async def _computed(self, work: StepWork, cache: KVCache, collective: JobCollective) -> Env:
        """This rank's stage program over the step's rows (its peers in ``collective``)."""
        stage = self._slice.stage
        layout = StepLayout([(span.seq, span.start, span.count) for span in work.layout])
        inputs: Env = {name: work.inputs[name].to_numpy() for name in stage.inputs}
        return await run_stage(
            stage,
            self._slice.runners,
            inputs,
            collective,
            outputs_at_leader=True,
            attention=StepAttention(cache, layout),
            pieces=self._slice.pieces,
        )

    async def _sampled(self, work: StepWork, outputs: Env) -> Sampled:
        """The next token of each logit row, on the last stage's leader; else nothing."""
        if not (self._last_stage and self._slice.is_leader):
            return Sampled()
        return await self._sample(outputs, work.sampling)

    async def _sample(self, outputs: Env, rows: tuple[RowSampling, ...]) -> Sampled:
        logits = outputs.get(LOGITS)
        if logits is None:
            raise StepFailedError(
                ErrorCode.INTERNAL, f"rank {self._slice.rank}: the last stage made no {LOGITS}"
            )
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        if logits.nbytes > OFF_LOOP_BYTES:
            sampled = await asyncio.to_thread(sample_rows, logits, rows)
        else:
            sampled = sample_rows(logits, rows)
        if sampled.broken:
            _logger.warning("logit rows %s are not finite: their sequences end", sampled.broken)
        return Sampled(tuple(sampled.tokens), tuple(sampled.logprobs), sampled.broken)

    def _forget(self, work: StepWork, cache: KVCache) -> None:
        """Free every sequence the step touches (see the module docstring)."""
        for span in work.layout:
            cache.free(span.seq)
        for reservation in work.reserve:
            cache.free(reservation.seq)

    def _error(self, work: StepWork, code: ErrorCode, message: str) -> StepResult:
        return step_failed(work, self._slice.rank, code, message, self._kv_used())
