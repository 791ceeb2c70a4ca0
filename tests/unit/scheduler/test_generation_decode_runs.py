"""Decode runs: several decode steps per StepWork for a one-stage group. K chosen from the
rule (one stage, decode rows only, nobody waiting; capped by max, run time, tokens left and
KV reservations); each streamed iteration becomes chunks at once; a sequence that stops or
is cancelled mid-run gets one last chunk and no more; a failure mid-run ends every stream
once; late, duplicate and stray results are counted and change nothing."""

from __future__ import annotations

from test_generation_kit import Bench, request

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo, StepResult, StepWork
from shardserve_scheduler.core.actions import Cancel
from shardserve_scheduler.core.generation.state import Limits

STEP_S = 0.010  # each scripted iteration takes 10 ms on the bench's clock


def timed(bench: Bench, work: StepWork) -> None:
    """Answer ``work`` as a mesh whose every iteration takes STEP_S (the leader streams
    iteration i at publish + (i + 1) * STEP_S, every rank answers the last then)."""
    bench.pending.remove(work)
    for iteration in range(work.decode_steps - 1):
        bench.now += STEP_S
        bench.take(bench.machine.on_step_result(bench.streamed(work, iteration), bench.now))
    bench.now += STEP_S
    for rank in bench.group.stages[work.stage].ranks:
        result = bench.result(work, rank, None)
        if result is not None:  # None: combined at the leader, which answers alone
            bench.take(bench.machine.on_step_result(result, bench.now))


def run_timed(bench: Bench) -> list[int]:
    """Every step until idle, timed; their decode_steps."""
    ks = []
    while bench.pending:
        ks.append(bench.pending[0].decode_steps)
        timed(bench, bench.pending[0])
    return ks


def tokens(bench: Bench, corr: str) -> list[int]:
    return [t for c in bench.chunks[corr] for t in c.token_ids]


# ---------------------------------------------------------------- choosing K


def test_k_grows_to_the_run_time_once_a_decode_step_is_timed() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=50.0))
    bench.generate("a", request("a", max_tokens=40))
    # prefill (untimed), one decode step (timed: 10 ms), then runs of 50 / 10 = 5 steps
    assert run_timed(bench)[:4] == [1, 1, 5, 5]
    assert bench.last("a").finish_reason == "length"
    assert tokens(bench, "a") == [100 + i for i in range(40)]
    assert [c.seq for c in bench.chunks["a"]] == list(range(40))  # one chunk per token


def test_k_is_capped_by_max_decode_steps() -> None:
    bench = Bench(limits=Limits(max_decode_steps=3, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=20))
    assert set(run_timed(bench)[2:-1]) == {3}


def test_k_is_capped_by_the_tokens_left_so_no_step_is_wasted() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=6))
    # prefill gives token 1, one decode step token 2: 4 left
    assert run_timed(bench) == [1, 1, 4]
    assert tokens(bench, "a") == [100 + i for i in range(6)]
    assert bench.last("a").finish_reason == "length"


def test_k_is_capped_by_the_shortest_member() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=30))
    bench.generate("b", request("b", max_tokens=5))
    # a's prefill; a's decode and b's prefill; a timed decode step; then b's 3 tokens left
    assert run_timed(bench)[:4] == [1, 1, 1, 3]
    assert len(tokens(bench, "a")) == 30 and len(tokens(bench, "b")) == 5


def test_k_is_capped_by_the_context_and_the_kv_reservation() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    # 120 prompt tokens, context 128: reserved 128 positions, 8 tokens may come
    bench.generate("a", request("a", prompt_ids=tuple(range(120))))
    ks = run_timed(bench)
    assert ks == [1, 1, 6]
    last_run = bench.steps[-1]
    # iteration i writes position start + i: the last one is the reservation's last
    assert last_run.layout[0].start + last_run.decode_steps - 1 == 127 - 1
    assert bench.last("a").finish_reason == "length" and len(tokens(bench, "a")) == 8


def test_k_never_writes_past_a_reservation_smaller_than_the_tokens_left() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=30))
    # (today a reservation always holds every token left; the rule must not rely on it)
    bench.machine.state.sequences[1].capacity = 4 + 5
    run_timed_steps(bench, 2)
    run = bench.pending[0]
    # length 6 (4 prompt + 2 generated): positions 5..8 are reserved, so 4 iterations
    assert run.layout[0].start == 5 and run.decode_steps == 4


def test_k_is_capped_by_the_run_time() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=25.0))
    bench.generate("a", request("a", max_tokens=30))
    assert set(run_timed(bench)[2:-1]) == {2}  # 25 ms / 10 ms


def test_a_slow_iteration_makes_runs_shorter() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=50.0))
    bench.generate("a", request("a", max_tokens=60))
    timed(bench, bench.pending[0])  # prefill
    bench.now += 0.190  # a decode step of 200 ms in all
    timed(bench, bench.pending[0])
    assert bench.pending[0].decode_steps == 1  # 200 ms: 50 ms holds no second step
    ks = run_timed(bench)
    # the average comes down towards 10 ms again, the runs grow back
    assert ks[:3] == [1, 1, 1] and max(ks) == 4 and ks.index(4) > ks.index(2)


def test_a_group_of_several_stages_never_runs() -> None:
    bench = Bench(stage_size=2, limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=12))
    bench.generate("b", request("b", max_tokens=12))
    bench.run_until_idle()
    assert {w.decode_steps for w in bench.steps} == {1}
    assert len(tokens(bench, "a")) == 12 and len(tokens(bench, "b")) == 12


def test_max_decode_steps_1_is_one_step_per_token() -> None:
    bench = Bench(limits=Limits(max_decode_steps=1))
    bench.generate("a", request("a", max_tokens=10))
    assert run_timed(bench) == [1] * 10


def test_no_run_while_a_sequence_waits_for_admission() -> None:
    # room for one sequence: b waits for a's KV
    bench = Bench(kv_tokens=30, limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=20))
    bench.generate("b", request("b", max_tokens=20))
    assert bench.machine.waiting("llama", 1) == 1
    while bench.machine.waiting("llama", 1):
        assert bench.pending[0].decode_steps == 1
        timed(bench, bench.pending[0])
    assert len(tokens(bench, "a")) == 20  # b took a's room when a ended
    assert max(run_timed(bench)) == 8  # nobody waits: b runs
    assert len(tokens(bench, "b")) == 20


def test_a_new_sequence_waits_for_the_run_then_its_prefill_runs_alone() -> None:
    bench = Bench(limits=Limits(max_decode_steps=8, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=30))
    run_timed_steps(bench, 2)
    run = bench.pending[0]
    assert run.decode_steps == 8
    bench.generate("b", request("b", max_tokens=30))
    assert bench.pending == [run]  # b joins the lane; the run goes on
    timed(bench, run)
    prefill = bench.pending[0]
    assert prefill.decode_steps == 1 and [s.seq for s in prefill.layout] == [1, 2]
    run_timed(bench)
    assert tokens(bench, "a") == [100 + i for i in range(30)]
    assert tokens(bench, "b") == [100 + i for i in range(30)]


def run_timed_steps(bench: Bench, count: int) -> None:
    for _ in range(count):
        timed(bench, bench.pending[0])


def test_run_rows_sample_from_the_sequence_s_next_index() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    bench.generate("a", request("a", max_tokens=12, temperature=0.7))
    run_timed_steps(bench, 2)
    run = bench.pending[0]
    assert run.decode_steps == 4
    assert [(r.index, r.seed, r.temperature) for r in run.sampling] == [(2, 7, 0.7)]
    assert [(s.start, s.count) for s in run.layout] == [(4 + 2 - 1, 1)]


# ---------------------------------------------------------------- streaming a run


def start_run(bench: Bench, *names: str, max_tokens: int = 30) -> StepWork:
    """The first decode run of sequences ``names`` (after their prefill and a timed step)."""
    for name in names:
        bench.generate(name, request(name, max_tokens=max_tokens))
    for _ in range(len(names) + 1):
        assert bench.pending[0].decode_steps == 1
        timed(bench, bench.pending[0])
    run = bench.pending.pop(0)  # the test answers it
    assert run.decode_steps > 1
    return run


def finish(bench: Bench, run: StepWork) -> None:
    """Every rank answers the run's last iteration."""
    for rank in bench.group.stages[run.stage].ranks:
        result = bench.result(run, rank, None)
        assert result is not None
        bench.take(bench.machine.on_step_result(result, bench.now))


def test_each_streamed_iteration_is_a_chunk_at_once() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a", "b")
    before = {name: len(bench.chunks[name]) for name in "ab"}
    for iteration in range(3):
        bench.take(bench.machine.on_step_result(bench.streamed(run, iteration), bench.now))
        for name in "ab":
            assert len(bench.chunks[name]) == before[name] + iteration + 1
        assert bench.pending == []  # the step goes on: no next step yet
    finish(bench, run)
    assert len(bench.chunks["a"]) == before["a"] + 4 and len(bench.pending) == 1


def test_a_sequence_stopping_mid_run_gets_one_last_chunk_and_is_freed_next_step() -> None:
    stop = 777
    script = {(1, 4): stop}  # sequence 1's 5th token is a stop id
    bench = Bench(
        limits=Limits(max_decode_steps=6, decode_run_ms=1000.0),
        script=lambda seq, index: script.get((seq, index), 100 + index),
    )
    bench.generate("a", request("a", max_tokens=30, stop_token_ids=(stop,)))
    bench.generate("b", request("b", max_tokens=30))
    run_timed_steps(bench, 3)
    run = bench.pending[0]
    # a's indexes 3..8 (b's 2..7): a stops at the run's 2nd iteration
    assert run.decode_steps == 6 and [r.index for r in run.sampling] == [3, 2]
    timed(bench, run)
    last = bench.last("a")
    assert last.finish_reason == "stop" and last.token_ids == (stop,)
    assert tokens(bench, "a") == [100, 101, 102, 103, stop]  # nothing after the stop
    assert len(tokens(bench, "b")) == 8
    nxt = bench.pending[0]
    assert nxt.free == (1,) and [s.seq for s in nxt.layout] == [2]
    run_timed(bench)
    assert bench.last("b").finish_reason == "length" and len(tokens(bench, "b")) == 30


def test_a_cancel_mid_run_ends_the_stream_once_and_later_tokens_are_ignored() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a", "b")
    bench.take(bench.machine.on_step_result(bench.streamed(run, 0), bench.now))
    bench.take(bench.machine.on_cancel("reply.q", "a", bench.now))
    count = len(bench.chunks["a"])
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.CANCELLED
    assert bench.pending == []  # the run goes on for b
    bench.take(bench.machine.on_step_result(bench.streamed(run, 1), bench.now))
    bench.take(bench.machine.on_step_result(bench.streamed(run, 2), bench.now))
    finish(bench, run)
    assert len(bench.chunks["a"]) == count
    assert bench.pending[0].free == (1,)


def test_a_rank_error_mid_run_ends_every_stream_once_and_cancels_the_run() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a", "b")
    bench.take(bench.machine.on_step_result(bench.streamed(run, 0), bench.now))
    error = ErrorInfo(code=ErrorCode.INTERNAL, message="onnxruntime failed")
    failed = StepResult(
        step=run.step, servable=run.servable, version=1, stage=0, rank=1, error=error, iteration=1
    )
    actions = bench.take(bench.machine.on_step_result(failed, bench.now))
    assert [a.cancel.job for a in actions if isinstance(a, Cancel)] == [run.step]
    for name in "ab":
        last = bench.last(name)
        assert last.error is not None and "rank 1 failed stage 0" in last.error.message
    assert sorted(f.free.seqs for f in bench.frees) == [(1, 2)]
    counts = {name: len(bench.chunks[name]) for name in "ab"}
    # what the leader still sends of the cancelled run changes nothing
    bench.take(bench.machine.on_step_result(bench.streamed(run, 1), bench.now))
    result = bench.result(run, 0, None)
    assert result is not None
    bench.take(bench.machine.on_step_result(result, bench.now))
    assert {name: len(bench.chunks[name]) for name in "ab"} == counts
    assert bench.machine.state.counters.late_results == 2
    assert bench.machine.open_sequences == 0 and bench.machine.running("llama", 1) == 0


def test_a_run_timing_out_fails_its_sequences_once() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0, step_timeout=5.0))
    run = start_run(bench, "a")
    bench.take(bench.machine.on_step_result(bench.streamed(run, 0), bench.now))
    actions = bench.take(bench.machine.on_tick(bench.now + 5.0))
    assert any(isinstance(a, Cancel) for a in actions)
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.STAGE_FAILED


def test_ranks_disagreeing_on_a_run_s_tokens_is_a_rank_mismatch() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a")
    for iteration in range(3):
        bench.take(bench.machine.on_step_result(bench.streamed(run, iteration), bench.now))
    for rank in (0, 1):
        result = bench.result(run, rank, None)
        assert result is not None
        digest = "d" if rank == 0 else "other"
        bench.take(
            bench.machine.on_step_result(result.model_copy(update={"digest": digest}), bench.now)
        )
    last = bench.last("a")
    assert last.error is not None and last.error.code == ErrorCode.RANK_MISMATCH


def test_a_run_waits_for_every_rank_even_where_outputs_combine_at_the_leader() -> None:
    bench = Bench(final_gather=True, limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a")
    for iteration in range(3):
        bench.take(bench.machine.on_step_result(bench.streamed(run, iteration), bench.now))
    leader = bench.result(run, 0, None)
    assert leader is not None
    bench.take(bench.machine.on_step_result(leader, bench.now))
    assert bench.pending == []  # rank 1's agreement is still missing
    other = bench.result(run, 1, None)
    assert other is not None
    bench.take(bench.machine.on_step_result(other, bench.now))
    assert len(bench.pending) == 1


def test_duplicate_stray_and_out_of_order_results() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a")
    counters = bench.machine.state.counters
    first = bench.streamed(run, 0)
    bench.take(bench.machine.on_step_result(first, bench.now))
    count = len(bench.chunks["a"])
    bench.take(bench.machine.on_step_result(first, bench.now))  # again
    from_peer = first.model_copy(update={"rank": 1, "iteration": 1})
    bench.take(bench.machine.on_step_result(from_peer, bench.now))  # only the leader streams
    beyond = first.model_copy(update={"iteration": 9, "rank": 1})
    bench.take(bench.machine.on_step_result(beyond, bench.now))  # no such iteration
    assert (counters.duplicate_results, counters.stray_results) == (1, 2)
    assert len(bench.chunks["a"]) == count
    # a skipped iteration cannot be streamed in order: the step fails loudly
    bench.take(bench.machine.on_step_result(bench.streamed(run, 2), bench.now))
    last = bench.last("a")
    assert last.error is not None and "iteration 2 came before 1" in last.error.message


def test_a_final_result_before_the_streamed_ones_fails_the_step() -> None:
    bench = Bench(limits=Limits(max_decode_steps=4, decode_run_ms=1000.0))
    run = start_run(bench, "a")
    for rank in (0, 1):
        result = bench.result(run, rank, None)
        assert result is not None
        bench.take(bench.machine.on_step_result(result, bench.now))
    last = bench.last("a")
    assert last.error is not None and "ended after 1 of 4 steps" in last.error.message
