"""Generation steps on agents: the Llama fixture exported at TP 1 and TP 2, real onnxruntime,
StageWorkers whose collective parts go straight to each other's hub (no broker)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.amqp.collective import CollectiveHub
from shardserve.errors import ErrorCode
from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.kv_shape import cache_shape
from shardserve.tools.export.hf import export_hf
from shardserve.tools.export.matmul import export_matmul
from shardserve.wire.protocol import (
    CollectivePart,
    RowSampling,
    SequenceReservation,
    SequencesFree,
    SequenceSpan,
    StageResult,
    StepResult,
    StepWork,
)
from shardserve.wire.tensors import DIGEST_PREFIX, Tensor, digest_tensors
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import LoadedSlice, load_slice
from shardserve_agent.worker import StageWorker

LLAMA = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "llama"
REFERENCE = json.loads((LLAMA / "reference.json").read_text())
BUDGET = 1 << 22  # 4 MiB: ~500 tokens of the fixture on one rank
Rows = list[tuple[int, list[int], int]]  # (seq, token ids, first position)


def load_ranks(repo: Path, servable: str, size: int) -> list[LoadedSlice]:
    return [
        load_slice(AgentSettings(repository=repo, servable=servable, rank=r, use_cache=False))
        for r in range(size)
    ]


@pytest.fixture(scope="module")
def slices(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[LoadedSlice]]:
    repo = tmp_path_factory.mktemp("repo")
    for size in (1, 2):
        export_hf(LLAMA, repo, rank_size=size, name=f"llama{size}")
    return {size: load_ranks(repo, f"llama{size}", size) for size in (1, 2)}


class Stage:
    """The ranks of one stage: a worker each, their hubs passing parts to each other (to
    all, or to one as the agents' point-to-point sends do)."""

    def __init__(self, loaded: list[LoadedSlice], budget: int = BUDGET) -> None:
        self.results: list[StepResult | StageResult] = []
        self.on_result: Callable[[StepResult | StageResult], None] | None = None
        ranks = tuple(s.rank for s in loaded)
        self.hubs = [
            CollectiveHub(
                rank=s.rank, stage=0, stage_ranks=ranks, publish=self._part, send_to=self._send
            )
            for s in loaded
        ]
        self.caches = [KVCache(cache_shape(s.group, s.rank), budget) for s in loaded]
        self.workers = [
            StageWorker(s, hub, self._result, kv_cache=cache)
            for s, hub, cache in zip(loaded, self.hubs, self.caches, strict=True)
        ]
        self.servable = loaded[0].group.servable

    async def _part(self, part: CollectivePart) -> None:
        for hub in self.hubs:
            hub.accept(part)

    async def _send(self, rank: int, part: CollectivePart) -> None:
        self.hubs[rank].accept(part)

    async def _result(self, to: str, result: StageResult | StepResult) -> None:
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    async def deliver(self, message: Any) -> list[StepResult]:
        """Every rank handles the message (as one publish reaches them all); the results."""
        self.results.clear()
        await asyncio.gather(*(w.handle(message, None) for w in self.workers))  # type: ignore[arg-type]
        return [r for r in self.results if isinstance(r, StepResult)]

    async def step(self, work: StepWork) -> StepResult:
        """The one success (or the first error) the step's ranks answer with."""
        results = await self.deliver(work)
        errors = [r for r in results if r.error is not None]
        return errors[0] if errors else _one(results)


def _one(results: Sequence[StepResult]) -> StepResult:
    assert len(results) == 1, results
    return results[0]


def step_work(
    servable: str,
    rows: Rows,
    *,
    reserve: Sequence[tuple[int, int]] = (),
    free: Sequence[int] = (),
    step: str = "s1",
    **over: Any,
) -> StepWork:
    """A stage-0 step over ``rows``; one logit row (greedy) at the end of each sequence."""
    ids = [t for _, tokens, _ in rows for t in tokens]
    positions = [p for _, tokens, start in rows for p in range(start, start + len(tokens))]
    ends = np.cumsum([len(tokens) for _, tokens, _ in rows]) - 1
    inputs = {
        "input_ids": Tensor.from_numpy(np.asarray(ids, np.int64)),
        "positions": Tensor.from_numpy(np.asarray(positions, np.int64)),
        "logit_rows": Tensor.from_numpy(ends.astype(np.int64)),
    }
    fields: dict[str, Any] = dict(
        step=step,
        servable=servable,
        version=1,
        stage=0,
        inputs=inputs,
        digest=digest_tensors(inputs),
        deadline=time.time() + 30,
        result_to="results",
        layout=tuple(SequenceSpan(seq=s, start=p, count=len(t)) for s, t, p in rows),
        reserve=tuple(SequenceReservation(seq=s, capacity=c) for s, c in reserve),
        free=tuple(free),
        sampling=tuple(RowSampling(seq=s, index=0) for s, _, _ in rows),
    )
    return StepWork(**{**fields, **over})


async def generate(
    stage: Stage, seqs: dict[int, list[int]], new_tokens: int
) -> dict[int, list[int]]:
    """Greedy continuations of every prompt, all sequences in every step together."""
    capacity = {s: len(p) + new_tokens for s, p in seqs.items()}
    texts = {s: list(p) for s, p in seqs.items()}
    rows: Rows = [(s, p, 0) for s, p in seqs.items()]
    reserve = list(capacity.items())
    for n in range(new_tokens):
        result = await stage.step(step_work(stage.servable, rows, reserve=reserve, step=f"s{n}"))
        assert result.error is None, result.error
        for (s, _, _), token in zip(rows, result.tokens, strict=True):
            texts[s].append(token)
        rows, reserve = [(s, [texts[s][-1]], len(texts[s]) - 1) for s in seqs], []
    return {s: texts[s][len(p) :] for s, p in seqs.items()}


@pytest.mark.parametrize("size", [1, 2])
async def test_greedy_prefill_and_decode_equal_transformers(
    size: int, slices: dict[int, list[LoadedSlice]]
) -> None:
    stage = Stage(slices[size])
    prompt = REFERENCE["prompts"][0]
    tokens = await generate(stage, {7: prompt["input_ids"]}, REFERENCE["new_tokens"])
    assert tokens[7] == prompt["greedy_ids"]


async def test_sequences_of_different_lengths_in_one_step_get_their_alone_tokens(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    prompts = {s: p["input_ids"] for s, p in enumerate(REFERENCE["prompts"])}
    together = await generate(Stage(slices[2]), prompts, 8)
    for s, prompt in enumerate(REFERENCE["prompts"]):
        assert together[s] == prompt["greedy_ids"][:8]


async def test_tp2_leader_samples_and_both_ranks_end_the_step(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[2])
    prompt = REFERENCE["prompts"][1]["input_ids"]
    work = step_work(stage.servable, [(3, prompt, 0)], reserve=[(3, 40)])
    results = await stage.deliver(work)
    # the logits are combined at the leader: it alone answers, with the token, no logits
    [result] = results
    assert result.rank == 0 and result.outputs is None and result.digest.startswith(DIGEST_PREFIX)
    assert result.tokens == (REFERENCE["prompts"][1]["greedy_ids"][0],)
    assert result.logprobs == (None,)
    expected = 40 * stage.caches[0].bytes_per_token
    assert result.kv_used_bytes == expected
    for worker in stage.workers:
        stats = worker.stats()
        assert (stats.sequences, stats.kv_used_bytes, stats.jobs_done) == (1, expected, 1)
        assert stats.kv_capacity_bytes == BUDGET and stats.kv_bytes_per_token > 0
        assert stats.inflight == 0


async def test_logprobs_come_with_the_token(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[1])
    prompt = REFERENCE["prompts"][0]["input_ids"]
    sampling = (RowSampling(seq=1, index=0, logprobs=2),)
    work = step_work(stage.servable, [(1, prompt, 0)], reserve=[(1, 30)], sampling=sampling)
    result = await stage.step(work)
    [logprob] = result.logprobs
    assert logprob is not None and logprob.token_id == result.tokens[0]
    assert logprob.top[0].token_id == result.tokens[0] and len(logprob.top) == 2


async def test_over_budget_reservation_fails_naming_the_numbers_and_reserves_nothing(
    slices: dict[int, list[LoadedSlice]], caplog: pytest.LogCaptureFixture
) -> None:
    stage = Stage(slices[2])
    per_token = stage.caches[0].bytes_per_token
    tokens = BUDGET // per_token + 1
    rows: Rows = [(1, [5, 6], 0), (2, [7], 0)]
    work = step_work(stage.servable, rows, reserve=[(1, 2), (2, tokens)])
    result = await stage.step(work)
    assert result.error is not None and result.error.code == ErrorCode.OVERLOADED
    assert f"needs {tokens * per_token} bytes for {tokens} tokens" in result.error.message
    assert f"{BUDGET - 2 * per_token} of {BUDGET} bytes free" in result.error.message
    assert all(not cache.sequences() for cache in stage.caches)  # sequence 1 rolled back
    assert "KV cache full" in caplog.text


async def test_a_sequence_not_held_fails_clearly(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[2])  # a fresh agent: its cache is empty
    result = await stage.step(step_work(stage.servable, [(7, [5], 12)]))
    assert result.error is not None and result.error.code == ErrorCode.INTERNAL
    assert result.error.message in {
        f"rank {r} holds no KV cache for sequence 7 (agent restarted?)" for r in (0, 1)
    }


async def test_a_failed_step_frees_its_sequences(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[1])
    ok = await stage.step(step_work(stage.servable, [(1, [5, 6, 7], 0)], reserve=[(1, 8)]))
    assert ok.error is None
    # sequence 2 asks for positions past its reservation: the step fails mid-program
    rows: Rows = [(1, [9], 3), (2, [1, 2, 3, 4], 0)]
    failed = await stage.step(step_work(stage.servable, rows, reserve=[(2, 3)], step="s2"))
    assert failed.error is not None and "exceed its reserved 3 tokens" in failed.error.message
    assert stage.caches[0].sequences() == ()
    assert failed.kv_used_bytes == 0


async def test_free_and_sequences_free_release_the_cache(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[2])
    rows: Rows = [(1, [5], 0), (2, [6], 0), (3, [7], 0)]
    reserve = [(1, 4), (2, 4), (3, 4)]
    assert (await stage.step(step_work(stage.servable, rows, reserve=reserve))).error is None
    again = step_work(stage.servable, [(3, [8], 1)], free=[1, 99], step="s2")
    assert (await stage.step(again)).error is None
    assert all(set(cache.sequences()) == {2, 3} for cache in stage.caches)
    free = SequencesFree(servable=stage.servable, version=1, stage=0, seqs=(2, 3, 42))
    assert await stage.deliver(free) == []
    assert all(cache.used_bytes == 0 for cache in stage.caches)
    other = SequencesFree(servable="elsewhere", version=1, stage=0, seqs=(1,))
    assert await stage.deliver(other) == []


async def test_expired_step_is_not_run_and_frees_its_sequences(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[1])
    work = step_work(stage.servable, [(1, [5], 0)], reserve=[(1, 4)], deadline=time.time() - 1)
    result = await stage.step(work)
    assert result.error is not None and result.error.code == ErrorCode.DEADLINE
    assert stage.caches[0].sequences() == ()


async def test_digest_mismatch_is_refused(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[1])
    work = step_work(
        stage.servable, [(1, [5], 0)], reserve=[(1, 4)], digest=DIGEST_PREFIX + "0" * 32
    )
    result = await stage.step(work)
    assert result.error is not None
    assert result.error.message == "rank 0: stage input digest mismatch (corrupted in transit?)"
    assert stage.caches[0].sequences() == ()


async def test_draining_answers_unavailable(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[1])
    stage.workers[0].draining = True
    result = await stage.step(step_work(stage.servable, [(1, [5], 0)], reserve=[(1, 4)]))
    assert result.error is not None and result.error.code == ErrorCode.UNAVAILABLE


async def test_cancelled_step_is_skipped_and_freed(slices: dict[int, list[LoadedSlice]]) -> None:
    stage = Stage(slices[1])
    stage.hubs[0].cancel("s1", "the scheduler gave up on it")
    assert await stage.deliver(step_work(stage.servable, [(1, [5], 0)], reserve=[(1, 4)])) == []
    assert stage.caches[0].sequences() == ()


async def test_work_for_another_servable_leaves_the_cache_alone(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[1])
    assert (
        await stage.step(step_work(stage.servable, [(1, [5], 0)], reserve=[(1, 4)]))
    ).error is None
    result = await stage.step(step_work("other", [(1, [6], 1)], step="s2"))
    assert result.error is not None and "got work for other v1 stage 0" in result.error.message
    assert stage.caches[0].sequences() == (1,)


async def test_a_servable_without_attention_refuses_steps(tmp_path: Path) -> None:
    export_matmul(tmp_path, rank_size=1, strategy="column")
    [loaded] = load_ranks(tmp_path, "matmul", 1)
    hub = CollectiveHub(rank=0, stage=0, stage_ranks=(0,), publish=_ignore)
    answers: list[StepResult] = []

    async def keep(to: str, result: Any) -> None:
        answers.append(result)

    worker = StageWorker(loaded, hub, keep)
    inputs = {"x": Tensor.from_numpy(np.ones((128, 96), np.float32))}
    work = StepWork(
        step="s",
        servable="matmul",
        version=1,
        stage=0,
        inputs=inputs,
        digest=digest_tensors(inputs),
        deadline=time.time() + 30,
        result_to="r",
    )
    await worker.handle(work, None)  # type: ignore[arg-type]
    [result] = answers
    assert result.error is not None and "serves no generation steps" in result.error.message
    assert worker.stats().kv_capacity_bytes == 0


async def _ignore(part: CollectivePart) -> None:
    return None


# ---------------------------------------------------------------- decode runs


def decode_work(
    servable: str,
    rows: Sequence[tuple[int, int, int]],
    steps: int,
    *,
    step: str = "run",
    index: int = 1,
    **sampling: Any,
) -> StepWork:
    """A decode run of ``steps`` iterations over rows (seq, last token, its position)."""
    spans: Rows = [(s, [token], position) for s, token, position in rows]
    rules = tuple(RowSampling(seq=s, index=index, **sampling) for s, _, _ in rows)
    return step_work(servable, spans, step=step, sampling=rules, decode_steps=steps)


async def prefilled(
    stage: Stage, prompts: dict[int, list[int]], room: int, **sampling: Any
) -> dict[int, int]:
    """Each prompt's prefill (reserving ``room`` more tokens); its first token."""
    rows: Rows = [(s, p, 0) for s, p in prompts.items()]
    rules = tuple(RowSampling(seq=s, index=0, **sampling) for s in prompts)
    reserve = [(s, len(p) + room) for s, p in prompts.items()]
    result = await stage.step(
        step_work(stage.servable, rows, reserve=reserve, step="prefill", sampling=rules)
    )
    assert result.error is None, result.error
    return dict(zip(prompts, result.tokens, strict=True))


async def single_steps(
    stage: Stage, prompts: dict[int, list[int]], steps: int, **sampling: Any
) -> dict[int, list[int]]:
    """Prefill, then ``steps`` ordinary decode steps; every sampled token per sequence."""
    first = await prefilled(stage, prompts, steps + 1, **sampling)
    tokens = {s: [t] for s, t in first.items()}
    for n in range(steps):
        rows = [(s, tokens[s][-1], len(p) + n) for s, p in prompts.items()]
        work = decode_work(stage.servable, rows, 1, step=f"d{n}", index=n + 1, **sampling)
        result = await stage.step(work)
        assert result.error is None, result.error
        for s, token in zip(prompts, result.tokens, strict=True):
            tokens[s].append(token)
    return tokens


@pytest.mark.parametrize(
    ("size", "sampling"), [(1, {}), (2, {}), (2, {"temperature": 0.9, "seed": 11})]
)
async def test_a_decode_run_gives_the_tokens_of_as_many_single_steps(
    size: int, sampling: dict[str, Any], slices: dict[int, list[LoadedSlice]]
) -> None:
    prompts = {s: p["input_ids"] for s, p in enumerate(REFERENCE["prompts"])}
    steps = 6
    alone = await single_steps(Stage(slices[size]), prompts, steps, **sampling)

    stage = Stage(slices[size])
    first = await prefilled(stage, prompts, steps + 1, **sampling)
    rows = [(s, first[s], len(p)) for s, p in prompts.items()]
    results = await stage.deliver(decode_work(stage.servable, rows, steps, **sampling))
    assert all(r.error is None for r in results), results
    # the leader streams iterations 0..K-2; then every rank sends the last, all agreeing
    streamed = [r for r in results if r.iteration < steps - 1]
    finals = [r for r in results if r.iteration == steps - 1]
    assert [(r.rank, r.iteration, r.digest) for r in streamed] == [
        (0, i, "") for i in range(steps - 1)
    ]
    assert sorted(r.rank for r in finals) == list(range(size))
    assert len({r.digest for r in finals}) == 1 and finals[0].digest.startswith(DIGEST_PREFIX)
    assert [r.tokens for r in finals if r.rank != 0] == [()] * (size - 1)
    leader_final = next(r for r in finals if r.rank == 0)
    run = [first] + [dict(zip(prompts, r.tokens, strict=True)) for r in [*streamed, leader_final]]
    for s in prompts:
        assert [tokens[s] for tokens in run] == alone[s]
    if not sampling:  # greedy: transformers' continuation
        for s, prompt in enumerate(REFERENCE["prompts"]):
            assert alone[s] == prompt["greedy_ids"][: steps + 1]
    for worker in stage.workers:
        assert worker.stats().jobs_done == 2 and worker.stats().inflight == 0


async def test_a_decode_run_streams_logprobs_from_the_leader(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[2])
    prompt = REFERENCE["prompts"][0]["input_ids"]
    first = await prefilled(stage, {1: prompt}, 4)
    results = await stage.deliver(
        decode_work(stage.servable, [(1, first[1], len(prompt))], 3, logprobs=1)
    )
    with_tokens = [r for r in results if r.tokens]
    assert [r.iteration for r in with_tokens] == [0, 1, 2]
    for result in with_tokens:
        [logprob] = result.logprobs
        assert logprob is not None and logprob.token_id == result.tokens[0]


@pytest.mark.parametrize("size", [1, 2])
async def test_a_cancel_between_iterations_stops_the_run_on_every_rank(
    size: int, slices: dict[int, list[LoadedSlice]]
) -> None:
    stage = Stage(slices[size])
    prompt = REFERENCE["prompts"][0]["input_ids"]
    first = await prefilled(stage, {1: prompt}, 8)
    seen: list[int] = []

    def cancel_after_the_first(result: StepResult | StageResult) -> None:
        if isinstance(result, StepResult) and not seen:
            seen.append(result.iteration)
            for hub in stage.hubs:  # what a JobCancel of the step does on each agent
                hub.cancel("run", "the scheduler failed the step")

    stage.on_result = cancel_after_the_first
    results = await stage.deliver(decode_work(stage.servable, [(1, first[1], len(prompt))], 8))
    assert seen == [0] and [r.iteration for r in results] == [0]
    assert all(cache.sequences() == () for cache in stage.caches)  # freed, as a cancelled step


async def test_a_decode_run_that_fails_mid_run_frees_and_reports_once(
    slices: dict[int, list[LoadedSlice]],
) -> None:
    stage = Stage(slices[1])
    prompt = REFERENCE["prompts"][0]["input_ids"]
    first = await prefilled(stage, {1: prompt}, 1)
    # room for one more token: iteration 0 writes it, iteration 1 would write past it
    results = await stage.deliver(decode_work(stage.servable, [(1, first[1], len(prompt))], 4))
    errors = [r for r in results if r.error is not None]
    assert len(errors) == 1 and "exceed its reserved" in errors[0].error.message
    assert [r.iteration for r in results if r.error is None] == [0]
    assert stage.caches[0].sequences() == ()


async def test_a_decode_run_is_refused_in_a_multi_stage_group(tmp_path: Path) -> None:
    export_hf(LLAMA, tmp_path, rank_size=2, stage_size=2, name="pp")
    loaded = load_ranks(tmp_path, "pp", 1)
    stage = Stage(loaded)
    work = decode_work("pp", [(1, 5, 0)], 2)
    result = await stage.step(work)
    assert result.error is not None and "needs a group of one stage, not 2" in result.error.message
