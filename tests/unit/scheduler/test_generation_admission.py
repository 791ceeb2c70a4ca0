"""Admission: whole-length KV reservation, the bounded waiting queue, 400 and 503."""

from __future__ import annotations

from test_generation_kit import Bench, request

from shardserve.errors import ErrorCode
from shardserve_scheduler.core.generation.state import Limits


def test_max_tokens_left_out_reserves_and_generates_up_to_the_context() -> None:
    bench = Bench()
    bench.generate("a", request("a", prompt_ids=tuple(range(100))))
    assert bench.steps[0].reserve[0].capacity == 128
    bench.run_until_idle()
    last = bench.last("a")
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 28  # context full


def test_400_when_max_tokens_goes_beyond_the_context() -> None:
    bench = Bench()
    bench.generate("a", request("a", prompt_ids=tuple(range(100)), max_tokens=29))
    (only,) = bench.chunks["a"]
    assert only.error is not None and only.error.code == ErrorCode.BAD_INPUT
    assert only.error.message.startswith("max_tokens is 29")
    assert "context is 128 tokens and the prompt has 100: at most 28" in only.error.message
    assert not bench.steps
    bench.generate("b", request("b", prompt_ids=tuple(range(100)), max_tokens=28))
    assert bench.steps[0].reserve[0].capacity == 128


def test_waits_while_the_kv_cache_is_full_then_starts_when_room_frees() -> None:
    bench = Bench(kv_tokens=20)
    bench.generate("a", request("a", max_tokens=12))  # 16 tokens
    bench.generate("b", request("b", max_tokens=12))  # 16 more: does not fit now
    assert bench.machine.waiting("llama", 1) == 1 and "b" not in bench.chunks
    assert [s.seq for w in bench.steps for s in w.layout] == [1]
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"
    assert bench.last("b").finish_reason == "length"  # started once a's free was published
    b_first = next(w for w in bench.steps if any(s.seq == 2 for s in w.layout))
    assert bench.frees[0].free.seqs == (1,) and b_first.reserve[0].seq == 2


def test_fifo_a_small_request_does_not_overtake_a_waiting_one() -> None:
    bench = Bench(kv_tokens=20)
    bench.generate("a", request("a", max_tokens=12))
    bench.generate("b", request("b", max_tokens=12))
    bench.generate("c", request("c", max_tokens=1))  # would fit, but b waits first
    assert bench.machine.waiting("llama", 1) == 2


def test_503_with_retry_after_when_the_waiting_queue_is_full() -> None:
    bench = Bench(kv_tokens=20, limits=Limits(max_waiting=1))
    bench.generate("a", request("a", max_tokens=12))
    bench.generate("b", request("b", max_tokens=12))
    bench.generate("c", request("c", max_tokens=12))
    (only,) = bench.chunks["c"]
    assert only.seq == 0 and only.error is not None
    assert only.error.code == ErrorCode.OVERLOADED and only.error.retry_after_s == 1.0
    assert "--max-waiting-sequences" in only.error.message


def test_max_running_sequences_makes_others_wait() -> None:
    bench = Bench(limits=Limits(max_running=1))
    bench.generate("a", request("a", max_tokens=2))
    bench.generate("b", request("b", max_tokens=2))
    assert bench.machine.running("llama", 1) == 1 and bench.machine.waiting("llama", 1) == 1
    bench.run_until_idle()
    assert bench.last("b").finish_reason == "length"


def test_400_never_fits_names_the_limit() -> None:
    bench = Bench(kv_tokens=20)
    bench.generate("a", request("a", max_tokens=30))
    (only,) = bench.chunks["a"]
    assert only.error is not None and only.error.code == ErrorCode.BAD_INPUT
    assert "needs 34 tokens" in only.error.message
    assert "rank 0 holds at most 20 tokens" in only.error.message
    assert bench.steps == []


def test_400_when_the_prompt_fills_the_context() -> None:
    bench = Bench()
    bench.generate("a", request("a", prompt_ids=tuple(range(128))))
    (only,) = bench.chunks["a"]
    assert only.error is not None and only.error.code == ErrorCode.BAD_INPUT
    assert "context is 128 tokens" in only.error.message


def test_a_request_without_seed_gets_one_at_admission() -> None:
    bench = Bench()
    bench.generate("a", request("a", temperature=0.8))
    bench.generate("b", request("b", temperature=0.8, seed=42))
    bench.run_step()
    assert bench.steps[0].sampling[0].seed == 7  # the bench's seed source
    assert [r.seed for r in bench.steps[1].sampling] == [7, 42]
    assert bench.steps[1].sampling[0].temperature == 0.8
