"""A failed step is cancelled on every rank of its group (JobCancel by step id): a live
rank waiting in a collective for a lost rank's parts, and the frees queued behind that
step, would otherwise wait for the step's deadline."""

from __future__ import annotations

from test_generation_kit import Bench, request

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo, JobCancel
from shardserve_scheduler.core.actions import Action, Cancel
from shardserve_scheduler.core.generation.state import Limits


def cancels(actions: list[Action]) -> list[JobCancel]:
    return [a.cancel for a in actions if isinstance(a, Cancel)]


def test_rank_lost_cancels_the_steps_in_flight() -> None:
    bench = Bench(stage_size=2)
    bench.generate("a", request("a", max_tokens=12))
    bench.run_step()  # stage 0 answered: the step is in flight at stage 1
    in_flight = bench.pending[0]
    actions = bench.take(bench.machine.on_rank_lost("llama", 1, "llama v1 lost rank 3", 1.0))
    (cancel,) = cancels(actions)
    assert (cancel.job, cancel.servable, cancel.version) == (in_flight.step, "llama", 1)
    assert "lost rank 3" in cancel.reason


def test_step_timeout_cancels_the_step() -> None:
    bench = Bench(limits=Limits(step_timeout=2.0))
    bench.generate("a", request("a", max_tokens=5))
    step = bench.pending[0].step
    assert [c.job for c in cancels(bench.take(bench.machine.on_tick(2.0)))] == [step]


def test_a_rank_error_cancels_the_step_on_the_other_ranks() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=5))
    work = bench.pending[0]
    actions = bench.answer(work, ErrorInfo(code=ErrorCode.INTERNAL, message="boom"))
    assert [c.job for c in cancels(actions)] == [work.step]


def test_no_cancel_without_a_failure() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=3))
    actions: list[Action] = []
    while bench.pending:
        actions += bench.run_step()
    assert cancels(actions) == [] and bench.last("a").finish_reason == "length"
