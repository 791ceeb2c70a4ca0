"""Continuous batching, micro-batches, chunked prefill, chunk numbering (pure, manual clock)."""

from __future__ import annotations

from test_generation_kit import Bench, request

from shardserve_scheduler.core.generation.state import Limits


def test_one_sequence_prefill_then_decodes_until_max_tokens() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=3))
    first = bench.steps[0]
    assert [(s.seq, s.start, s.count) for s in first.layout] == [(1, 0, 4)]
    assert [(r.seq, r.capacity) for r in first.reserve] == [(1, 7)]
    assert first.inputs["logit_rows"].to_numpy().tolist() == [3]
    assert first.sampling[0].seed == 7 and first.sampling[0].index == 0
    bench.run_until_idle()
    decode = bench.steps[1]
    assert [(s.start, s.count) for s in decode.layout] == [(4, 1)]
    assert decode.inputs["input_ids"].to_numpy().tolist() == [100]
    assert decode.reserve == ()
    last = bench.last("a")
    assert [c.token_ids for c in bench.chunks["a"]] == [(100,), (101,), (102,)]
    assert last.finish_reason == "length"
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        4,
        3,
    )
    assert len(bench.steps) == 3  # no step after the last token: the lane is empty
    assert [f.free.seqs for f in bench.frees] == [(1,)]  # freed at once (no next step)


def test_a_new_sequence_joins_between_steps_and_a_finished_one_leaves_at_once() -> None:
    bench = Bench()
    bench.generate("a", request("a", max_tokens=2))
    step0 = bench.pending[0]
    bench.generate("b", request("b", prompt_ids=(0, 9), max_tokens=4))
    assert len(bench.pending) == 1  # b waits for the lane's next step
    bench.run_step()
    step1 = bench.steps[1]
    assert [(s.seq, s.start, s.count) for s in step1.layout] == [(1, 4, 1), (2, 0, 2)]
    assert [r.seq for r in step1.reserve] == [2]
    assert step0.free == ()
    bench.run_step()  # a gets its 2nd token: done
    assert bench.last("a").finish_reason == "length"
    step2 = bench.steps[2]
    assert step2.free == (1,)  # a's id in the next step's free
    assert [s.seq for s in step2.layout] == [2]
    bench.run_until_idle()
    assert bench.last("b").usage is not None
    assert bench.machine.open_sequences == 0


def test_two_stages_run_two_lanes_in_flight() -> None:
    bench = Bench(stage_size=2)
    bench.generate("a", request("a", max_tokens=3))
    bench.generate("b", request("b", max_tokens=3))
    assert [(w.stage, w.layout[0].seq) for w in bench.pending] == [(0, 1), (0, 2)]
    bench.run_step()  # a's step: stage 0 done -> relayed to stage 1
    relayed = bench.pending[-1]
    assert (relayed.stage, relayed.layout[0].seq) == (1, 1)
    assert relayed.reserve and relayed.reserve[0].seq == 1  # every stage reserves
    assert "hidden" in relayed.inputs and "input_ids" not in relayed.inputs
    assert {(w.step, w.stage) for w in bench.pending} == {
        (bench.steps[1].step, 0),
        (relayed.step, 1),
    }
    bench.run_until_idle()
    assert bench.text("a") == bench.text("b")
    assert bench.last("a").finish_reason == bench.last("b").finish_reason == "length"


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    bench = Bench(limits=Limits(max_prefill_tokens=3))
    bench.generate("a", request("a", prompt_ids=tuple(range(8)), max_tokens=2))
    bench.run_step()
    bench.run_step()
    spans = [[(s.start, s.count) for s in w.layout] for w in bench.steps[:3]]
    assert spans == [[(0, 3)], [(3, 3)], [(6, 2)]]
    assert [len(w.sampling) for w in bench.steps[:3]] == [0, 0, 1]
    assert "a" not in bench.chunks  # no token before the prompt is in
    assert bench.steps[0].reserve[0].capacity == 10 and bench.steps[1].reserve == ()
    bench.run_until_idle()
    assert bench.last("a").usage is not None


def test_prefill_budget_is_shared_and_decodes_always_go() -> None:
    bench = Bench(limits=Limits(max_prefill_tokens=4))
    bench.generate("a", request("a", prompt_ids=(0, 1), max_tokens=5))
    bench.generate("b", request("b", prompt_ids=(0, 1, 2, 3, 4, 5), max_tokens=1))
    bench.run_step()  # a's prefill (b joined meanwhile)
    layout = [(s.seq, s.start, s.count) for s in bench.steps[1].layout]
    assert layout == [(1, 2, 1), (2, 0, 4)]
    bench.run_step()
    assert [(s.seq, s.start, s.count) for s in bench.steps[2].layout] == [(1, 3, 1), (2, 4, 2)]


def test_chunk_seq_numbers_and_exactly_one_last_chunk() -> None:
    bench = Bench()
    for name in "abc":
        bench.generate(name, request(name, max_tokens=4 if name != "b" else 2))
    bench.run_until_idle()
    for name in "abc":
        bench.last(name)  # checks numbering from 0 and one last chunk
