"""Generation on real agent processes (the Llama fixture at TP 2) against a real RabbitMQ, the
test playing the scheduler: it registers the ranks, publishes StepWork on the stage
exchange and reads the StepResults, as the scheduler does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from scheduler_side import WAIT, SchedulerSide

from shardserve.amqp.broker import Broker
from shardserve.errors import ErrorCode
from shardserve.process.settings import BrokerSettings
from shardserve.tools.export.hf import export_hf
from shardserve.wire.protocol import (
    AgentHeartbeat,
    JobCancel,
    RowSampling,
    SequenceReservation,
    SequencesFree,
    SequenceSpan,
    StepResult,
    StepWork,
)
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve.wire.topology import (
    CONTROL_EXCHANGE,
    STAGE_EXCHANGE,
    group_key,
    stage_key,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
AGENT_SRC = ROOT / "services" / "agent" / "src"
LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"
REFERENCE = json.loads((LLAMA / "reference.json").read_text())
KV_CACHE_MB = 1
Rows = list[tuple[int, list[int], int]]  # (seq, token ids, first position)


class Mesh(SchedulerSide):
    """The test's scheduler side: control and result queues of its own, StepWork out."""

    def __init__(self, broker: Broker, servable: str) -> None:
        super().__init__(broker, servable, StepResult)

    async def publish(self, message: StepWork | SequencesFree) -> None:
        await self.broker.publish(STAGE_EXCHANGE, stage_key(self.servable, 1, 0), message)

    async def answers(self, step: str, count: int) -> list[StepResult]:
        found: list[StepResult] = []
        async with asyncio.timeout(WAIT):
            while len(found) < count:
                result = await self.results.get()
                assert result.step == step, result
                found.append(result)
        return sorted(found, key=lambda r: r.rank)

    async def step(
        self, step: str, rows: Rows, reserve: Sequence[tuple[int, int]] = ()
    ) -> StepResult:
        """One step of every row's sequence; the leader's answer (the only one on success)."""
        await self.publish(self.step_work(step, rows, reserve))
        [result] = await self.answers(step, 1)
        assert result.error is None and result.rank == 0, result
        return result

    def step_work(
        self,
        step: str,
        rows: Rows,
        reserve: Sequence[tuple[int, int]],
        decode_steps: int = 1,
        index: int = 0,
    ) -> StepWork:
        ids = [t for _, tokens, _ in rows for t in tokens]
        positions = [p for _, tokens, start in rows for p in range(start, start + len(tokens))]
        ends = np.cumsum([len(tokens) for _, tokens, _ in rows]) - 1
        inputs = {
            "input_ids": Tensor.from_numpy(np.asarray(ids, np.int64)),
            "positions": Tensor.from_numpy(np.asarray(positions, np.int64)),
            "logit_rows": Tensor.from_numpy(ends.astype(np.int64)),
        }
        return StepWork(
            step=step,
            servable=self.servable,
            version=1,
            stage=0,
            inputs=inputs,
            digest=digest_tensors(inputs),
            deadline=time.time() + 30,
            result_to=self.result_queue.name,
            layout=tuple(SequenceSpan(seq=s, start=p, count=len(t)) for s, t, p in rows),
            reserve=tuple(SequenceReservation(seq=s, capacity=c) for s, c in reserve),
            sampling=tuple(RowSampling(seq=s, index=index) for s, _, _ in rows),
            decode_steps=decode_steps,
        )

    async def cancel(self, step: str) -> None:
        """What the scheduler sends when it gives up on a step (to every agent of it)."""
        cancel = JobCancel(job=step, servable=self.servable, version=1, reason="test gave up")
        await self.broker.publish(CONTROL_EXCHANGE, group_key(self.servable, 1), cancel)

    async def beat_with(self, rank: int, sequences: int) -> AgentHeartbeat:
        """The first heartbeat of ``rank`` that reports ``sequences`` sequences."""
        async with asyncio.timeout(WAIT):
            while (beat := await self.next(AgentHeartbeat, rank)).sequences != sequences:
                pass
        return beat


@pytest.fixture
async def mesh(isolated_amqp_url: str) -> AsyncIterator[Mesh]:
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), f"test-{uuid.uuid4().hex[:6]}")
    await broker.connect()
    fake = Mesh(broker, f"gen{uuid.uuid4().hex[:10]}")
    await fake.start()
    try:
        yield fake
    finally:
        await broker.close()


@pytest.fixture
def agents(
    isolated_amqp_url: str, mesh: Mesh, tmp_path: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two agent processes serving the fixture exported at TP 2."""
    repo = tmp_path / "repo"
    export_hf(LLAMA, repo, rank_size=2, name=mesh.servable)
    env = {
        **os.environ,
        "SHARDSERVE_AMQP_URL": isolated_amqp_url,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(AGENT_SRC), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for rank in (0, 1):
        args = ["--repository", str(repo), "--servable", mesh.servable, "--rank", str(rank)]
        args += ["--no-cache", "--heartbeat-interval", "0.3", "--kv-cache-mb", str(KV_CACHE_MB)]
        with (tmp_path / f"agent-r{rank}.log").open("ab") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "shardserve_agent", *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def test_two_ranks_generate_transformers_greedy_tokens(
    mesh: Mesh, agents: list[subprocess.Popen[bytes]]
) -> None:
    hellos = [await mesh.register(0), await mesh.register(1)]
    per_token = 4 * 2 * 1 * 16 * 4  # layers, K and V, one of 2 K/V heads per rank, head_dim, fp32
    for hello in hellos:
        assert (hello.kv_capacity_bytes, hello.kv_used_bytes) == (KV_CACHE_MB << 20, 0)
        assert (hello.kv_bytes_per_token, hello.sequences) == (per_token, 0)

    # two sequences of different lengths share every step: a prefill, then 24 decodes
    new_tokens = REFERENCE["new_tokens"]
    prompts = {1: REFERENCE["prompts"][0]["input_ids"], 2: REFERENCE["prompts"][1]["input_ids"]}
    texts = {s: list(p) for s, p in prompts.items()}
    rows: Rows = [(s, p, 0) for s, p in prompts.items()]
    reserve = [(s, len(p) + new_tokens) for s, p in prompts.items()]
    started = time.perf_counter()
    for n in range(new_tokens):
        if n == 1:
            started = time.perf_counter()  # decode steps only
        result = await mesh.step(f"step{n}", rows, reserve)
        assert result.outputs is None and len(result.tokens) == 2
        for (s, _, _), token in zip(rows, result.tokens, strict=True):
            texts[s].append(token)
        rows, reserve = [(s, [texts[s][-1]], len(texts[s]) - 1) for s in prompts], []
    decode_ms = (time.perf_counter() - started) * 1000 / (new_tokens - 1)
    print(
        f"TP2 decode step round trip: {decode_ms:.1f} ms (2 sequences); last step at the "
        f"leader: {result.compute_ms:.1f} ms compute, {result.collective_ms:.1f} ms collectives"
    )
    assert texts[1][len(prompts[1]) :] == REFERENCE["prompts"][0]["greedy_ids"]
    assert texts[2][len(prompts[2]) :] == REFERENCE["prompts"][1]["greedy_ids"]
    used = sum(len(p) + new_tokens for p in prompts.values()) * per_token
    assert result.kv_used_bytes == used
    for rank in (0, 1):
        assert (await mesh.beat_with(rank, 2)).kv_used_bytes == used

    # free: one by SequencesFree, then the step naming a freed sequence fails clearly
    await mesh.publish(SequencesFree(servable=mesh.servable, version=1, stage=0, seqs=(1, 77)))
    for rank in (0, 1):
        beat = await mesh.beat_with(rank, 1)
        assert beat.kv_used_bytes == (len(prompts[2]) + new_tokens) * per_token
    await mesh.publish(mesh.step_work("gone", [(1, [5], len(texts[1]))], ()))
    failed = await mesh.answers("gone", 2)
    assert [r.error.message if r.error else "" for r in failed] == [
        f"rank {r} holds no KV cache for sequence 1 (agent restarted?)" for r in (0, 1)
    ]

    # over the budget: both ranks refuse with the numbers, and keep what they had
    tokens = (KV_CACHE_MB << 20) // per_token
    await mesh.publish(mesh.step_work("big", [(9, [5], 0)], [(9, tokens)]))
    refused = await mesh.answers("big", 2)
    for answer in refused:
        assert answer.error is not None and answer.error.code == ErrorCode.OVERLOADED
        assert f"sequence 9 needs {tokens * per_token} bytes for {tokens} tokens" in (
            answer.error.message
        )
    await mesh.publish(SequencesFree(servable=mesh.servable, version=1, stage=0, seqs=(2,)))
    for rank in (0, 1):
        assert (await mesh.beat_with(rank, 0)).kv_used_bytes == 0
    assert all(proc.poll() is None for proc in agents)


async def test_a_decode_run_streams_its_tokens_and_a_cancel_stops_it_on_both_ranks(
    mesh: Mesh, agents: list[subprocess.Popen[bytes]]
) -> None:
    for rank in (0, 1):
        await mesh.register(rank)
    prompt = REFERENCE["prompts"][0]
    expected = prompt["greedy_ids"]
    ids, steps = prompt["input_ids"], len(expected) - 1
    first = await mesh.step("prefill", [(1, ids, 0)], [(1, len(ids) + steps + 1)])
    assert first.tokens == (expected[0],)

    # one StepWork, K iterations: the leader streams K-1, then both ranks answer the last
    await mesh.publish(mesh.step_work("run", [(1, [expected[0]], len(ids))], (), steps, 1))
    results = await mesh.answers("run", steps - 1 + 2)
    assert all(r.error is None for r in results), results
    streamed = sorted((r for r in results if r.iteration < steps - 1), key=lambda r: r.iteration)
    finals = [r for r in results if r.iteration == steps - 1]
    assert [(r.rank, r.iteration) for r in streamed] == [(0, i) for i in range(steps - 1)]
    assert sorted(r.rank for r in finals) == [0, 1] and finals[0].digest == finals[1].digest
    leader_last = next(r for r in finals if r.rank == 0)
    tokens = [first.tokens[0]] + [r.tokens[0] for r in [*streamed, leader_last]]
    assert tokens == expected  # transformers' greedy continuation

    # a long run, cancelled after its first streamed token: both ranks stop and free it
    room = len(ids) + 100
    await mesh.step("prefill2", [(2, ids, 0)], [(2, room)])
    await mesh.publish(mesh.step_work("long", [(2, [expected[0]], len(ids))], (), 90, 1))
    seen = await mesh.results.get()
    assert (seen.step, seen.iteration, seen.rank) == ("long", 0, 0)
    await mesh.cancel("long")
    for rank in (0, 1):
        assert (await mesh.beat_with(rank, 1)).kv_used_bytes > 0  # sequence 1 only
    # A prefill queued behind the run is the barrier: rank 0 works and answers in order, so
    # every result of the run it sent is in before the barrier's.
    await mesh.publish(mesh.step_work("barrier", [(3, ids, 0)], [(3, len(ids) + 1)]))
    late = []
    async with asyncio.timeout(WAIT):
        while (result := await mesh.results.get()).step != "barrier":
            late.append(result)
    assert result.error is None and result.rank == 0, result
    assert all(r.step == "long" and r.error is None for r in late)
    assert not [r for r in late if r.iteration == 89], "the run went to its end"
    assert all(proc.poll() is None for proc in agents)
