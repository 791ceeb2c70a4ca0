"""Cancel, deadline, rank loss, step errors and timeouts: every stream ends with exactly one
last chunk, KV room comes back, other sequences go on."""

from __future__ import annotations

from typing import Any

from test_generation_kit import Bench, request

from shardserve.errors import ErrorCode, InferenceError
from shardserve.wire.protocol import ErrorInfo
from shardserve_scheduler.core.actions import Log, SendChunk
from shardserve_scheduler.core.generation.sequences import Origin
from shardserve_scheduler.core.generation.state import Limits
from shardserve_scheduler.core.generation.text_stream import TextStream


def test_cancel_within_one_step_frees_in_the_next_step() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=50))
    bench.generate("b", request("b", max_tokens=50))
    bench.run_step()
    bench.take(bench.machine.on_cancel("reply.q", "a", bench.now))
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.CANCELLED
    count = len(bench.chunks["a"])
    bench.run_step()  # the step in flight still had a: its token is dropped
    assert len(bench.chunks["a"]) == count
    assert bench.steps[-1].free == (1,)
    assert [s.seq for s in bench.steps[-1].layout] == [2]


def test_cancel_of_a_lone_sequence_frees_with_a_sequences_free() -> None:
    bench = Bench(stage_size=2)
    bench.generate("a", request("a", max_tokens=50))
    bench.take(bench.machine.on_cancel("reply.q", "a", bench.now))
    assert bench.frees == []  # its step is still in flight: the free would overtake it
    bench.run_until_idle()
    assert sorted((f.free.stage, f.free.seqs) for f in bench.frees) == [(0, (1,)), (1, (1,))]
    assert bench.machine.running("llama", 1) == 0


def test_cancel_unknown_is_harmless() -> None:
    bench = Bench()
    assert bench.take(bench.machine.on_cancel("reply.q", "nobody", 0.0))
    assert bench.chunks == {}


def test_deadline_ends_running_and_waiting_sequences() -> None:
    bench = Bench(limits=Limits(max_running=1))
    bench.generate("a", request("a", max_tokens=50, deadline=5.0))
    bench.generate("b", request("b", max_tokens=50, deadline=5.0))
    bench.run_step()
    assert bench.machine.next_wakeup() == 5.0
    bench.take(bench.machine.on_tick(5.0))
    for name in "ab":
        last = bench.last(name)
        assert last.error is not None and last.error.code == ErrorCode.DEADLINE
    bench.run_until_idle()
    assert bench.machine.open_sequences == 0 and bench.machine.running("llama", 1) == 0


def test_rank_lost_ends_every_sequence_of_the_group_and_frees_live_ranks() -> None:
    bench = Bench(stage_size=2, kv_tokens=20)
    bench.generate("a", request("a", max_tokens=12))
    bench.generate("b", request("b", max_tokens=12))  # waits for room
    bench.run_step()
    bench.take(bench.machine.on_rank_lost("llama", 1, "llama v1 lost rank 3 (no heartbeat)", 1.0))
    for name in "ab":
        last = bench.last(name)
        assert last.error is not None and last.error.code == ErrorCode.RANK_LOST
        assert "rank 3" in last.error.message
    assert sorted((f.free.stage, f.free.seqs) for f in bench.frees) == [(0, (1,)), (1, (1,))]
    for work in list(bench.pending):  # late results of the dropped step are ignored
        bench.answer(work)
    assert len(bench.chunks["a"]) == 1
    bench.generate("c", request("c", max_tokens=12))  # the group healed: new ones run
    bench.run_until_idle()
    assert bench.last("c").finish_reason == "length"


def test_a_rank_error_fails_the_steps_sequences_and_frees_everywhere() -> None:
    bench = Bench(stage_size=2)
    bench.generate("a", request("a", max_tokens=5))
    bench.run_step()
    bench.answer(bench.pending[0], ErrorInfo(code=ErrorCode.INTERNAL, message="boom"))
    last = bench.last("a")
    assert last.error is not None and "boom" in last.error.message
    assert "rank 2 failed stage 1" in last.error.message
    assert sorted(f.free.stage for f in bench.frees) == [0, 1]
    assert bench.machine.running("llama", 1) == 0


def test_step_timeout_fails_the_step_and_names_the_silent_ranks() -> None:
    bench = Bench(limits=Limits(step_timeout=2.0))
    bench.generate("a", request("a", max_tokens=5))
    bench.take(bench.machine.on_tick(2.0))
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.STAGE_FAILED
    assert "ranks not answered: 0, 1" in last.error.message


def test_digest_disagreement_fails_the_step() -> None:
    bench = Bench(stage_size=2)
    bench.generate("a", request("a", max_tokens=5))
    work = bench.pending.pop(0)
    good = bench.result(work, 0, None)
    bad = bench.result(work, 1, None)
    assert good is not None and bad is not None
    bench.take(bench.machine.on_step_result(good, 0.0))
    bench.take(bench.machine.on_step_result(bad.model_copy(update={"digest": "x"}), 0.0))
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.RANK_MISMATCH


def test_final_gather_stage_needs_only_the_leader() -> None:
    bench = Bench(final_gather=True)
    bench.generate("a", request("a", max_tokens=2))
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"


def test_shutdown_ends_every_open_stream() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=5))
    bench.take(bench.machine.shutdown("scheduler shutting down", 0.0))
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.UNAVAILABLE


def test_a_request_reusing_a_live_correlation_id_is_refused_without_touching_that_stream() -> None:
    """Before, the duplicate's refusal chunk went to the live stream (an error in it)."""
    bench = Bench()
    bench.generate("a", request("a", max_tokens=3))
    before = list(bench.chunks.get("a", []))
    actions = bench.generate("a", request("intruder", max_tokens=3))
    assert not [a for a in actions if isinstance(a, SendChunk)]
    assert any(isinstance(a, Log) and "intruder" in a.message for a in actions)
    refusal = bench.machine.refuse(
        Origin(request("intruder"), "reply.q", "a"), InferenceError("no such servable")
    )
    assert not [a for a in refusal if isinstance(a, SendChunk)]
    assert bench.chunks.get("a", []) == before
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"


def test_a_vanished_reply_queue_ends_the_sequence_within_one_step() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=50))
    bench.generate("b", request("b", max_tokens=5))
    bench.run_step()
    bench.take(bench.machine.on_stream_gone("reply.q", "a", "no queue takes it", bench.now))
    assert bench.last("a").error is not None
    bench.run_step()
    assert [s.seq for s in bench.steps[-1].layout] == [2]  # a is gone from the next step
    bench.run_until_idle()
    assert bench.last("b").finish_reason == "length"
    assert bench.machine.running("llama", 1) == 0


class BrokenText(TextStream):
    """A detokenizer that fails on its second token (a bug or an unforeseen input)."""

    def __init__(self, stream: TextStream) -> None:
        self.__dict__.update(stream.__dict__)
        self._seen = 0

    def push(self, token: int) -> Any:
        self._seen += 1
        if self._seen == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return super().push(token)


def test_one_sequences_failing_text_ends_that_sequence_only() -> None:
    """Before, the exception failed the whole step: every sequence batched with it ended."""
    bench = Bench()
    bench.generate("a", request("a", max_tokens=6))
    bench.generate("b", request("b", max_tokens=6))
    (broken,) = [
        s for s in bench.machine.state.sequences.values() if s.origin.correlation_id == "a"
    ]
    broken.text = BrokenText(broken.text)
    bench.run_until_idle()
    failed = bench.last("a")
    assert failed.error is not None and failed.error.code == ErrorCode.INTERNAL
    assert bench.last("b").finish_reason == "length"
    assert len([c for c in bench.chunks["b"] if c.token_ids]) == 6
    assert bench.machine.running("llama", 1) == 0


def ended_and_went_on(bench: Bench) -> None:
    """a ended with the non-finite logits error at its third token; b got all six."""
    failed = bench.last("a")
    assert failed.error is not None and failed.error.code == ErrorCode.INTERNAL
    assert "not finite" in failed.error.message
    assert len([c for c in bench.chunks["a"] if c.token_ids]) == 2
    assert bench.last("b").finish_reason == "length"
    assert len([c for c in bench.chunks["b"] if c.token_ids]) == 6
    assert bench.machine.running("llama", 1) == 0


def test_a_non_finite_logit_row_ends_that_sequence_only() -> None:
    """Before, the agent failed the whole step: every sequence batched with it ended."""
    bench = Bench(limits=Limits(max_decode_steps=1))
    bench.generate("a", request("a", max_tokens=6))
    bench.generate("b", request("b", max_tokens=6))
    bench.broken.add((1, 2))  # sequence 1 (a), its third token
    bench.run_until_idle()
    ended_and_went_on(bench)


def test_a_non_finite_row_in_a_decode_run_ends_that_sequence_at_that_iteration() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=6))
    bench.generate("b", request("b", max_tokens=6))
    bench.now = 1.0
    bench.broken.add((1, 2))  # a's third token: an iteration of a run (later ones ignored)
    bench.run_until_idle()
    assert max(work.decode_steps for work in bench.steps) > 1
    ended_and_went_on(bench)
