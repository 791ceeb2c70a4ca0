"""Agent processes against a real RabbitMQ, with the test playing the scheduler's part."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scheduler_side import WAIT, SchedulerSide

from shardserve.amqp.broker import Broker
from shardserve.errors import ErrorCode
from shardserve.process.settings import BrokerSettings
from shardserve.tools.export.matmul import export_matmul
from shardserve.wire.protocol import (
    AgentBye,
    AgentHeartbeat,
    AgentHello,
    CollectivePart,
    JobCancel,
    SchedulerHello,
    StageResult,
    StageWork,
)
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve.wire.topology import (
    COLLECTIVE_EXCHANGE,
    CONTROL_EXCHANGE,
    KEY_SCHEDULER_HELLO,
    STAGE_EXCHANGE,
    group_key,
    stage_key,
)

pytestmark = pytest.mark.integration

AGENT_SRC = Path(__file__).resolve().parents[2] / "services" / "agent" / "src"


class AgentProcess:
    """One `python -m shardserve_agent` process and its log."""

    def __init__(self, amqp_url: str, log: Path, args: list[str]) -> None:
        self.log = log
        env = {
            **os.environ,
            "SHARDSERVE_AMQP_URL": amqp_url,
            "PYTHONUNBUFFERED": "1",
            "SHARDSERVE_LOG_LEVEL": "DEBUG",
            "PYTHONPATH": os.pathsep.join([str(AGENT_SRC), os.environ.get("PYTHONPATH", "")]),
        }
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shardserve_agent", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait(self, within_s: float = WAIT) -> int:
        deadline = time.monotonic() + within_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"agent still running after {within_s}s:\n{self.text()}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class FakeScheduler(SchedulerSide):
    """Receives agent control messages and stage results on queues of its own."""

    def __init__(self, broker: Broker, servable: str) -> None:
        super().__init__(broker, servable, StageResult)

    async def send_work(self, job: str, deadline_s: float = 30.0) -> StageWork:
        inputs = {"x": Tensor.from_numpy(np.ones((128, 96), dtype=np.float32))}
        work = StageWork(
            job=job,
            servable=self.servable,
            version=1,
            stage=0,
            inputs=inputs,
            digest=digest_tensors(inputs),
            deadline=time.time() + deadline_s,
            result_to=self.result_queue.name,
        )
        await self.broker.publish(STAGE_EXCHANGE, stage_key(self.servable, 1, 0), work)
        return work

    async def beat(self, rank: int, state: str, inflight: int) -> AgentHeartbeat:
        """The next heartbeat of ``rank`` in this state with this many jobs in flight."""
        async with asyncio.timeout(WAIT):
            while True:
                beat: AgentHeartbeat = await self.next(AgentHeartbeat, rank)
                if (beat.state, beat.inflight) == (state, inflight):
                    return beat

    async def waiting_for_peers(self, rank: int) -> None:
        """Until ``rank`` has a job in flight across two heartbeats: past its (tiny) compute,
        waiting for a peer's part that only the test can send."""
        await self.beat(rank, "ready", 1)
        await self.beat(rank, "ready", 1)

    async def collect(self, count: int) -> dict[int, StageResult]:
        found: dict[int, StageResult] = {}
        async with asyncio.timeout(WAIT):
            while len(found) < count:
                result = await self.results.get()
                found[result.rank] = result
        return found


@pytest.fixture
async def scheduler(isolated_amqp_url: str) -> AsyncIterator[FakeScheduler]:
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), f"test-{uuid.uuid4().hex[:6]}")
    await broker.connect()
    fake = FakeScheduler(broker, f"agt{uuid.uuid4().hex[:10]}")
    await fake.start()
    try:
        yield fake
    finally:
        await broker.close()


class Agents:
    """Starts agents for the scheduler's servable; kills leftovers at the end."""

    def __init__(self, amqp_url: str, repo: Path, tmp: Path, servable: str) -> None:
        self.amqp_url, self.repo, self.tmp, self.servable = amqp_url, repo, tmp, servable
        self.started: list[AgentProcess] = []

    def start(self, rank: int, *extra: str) -> AgentProcess:
        log = self.tmp / f"agent-r{rank}-{len(self.started)}.log"
        args = [
            "--repository",
            str(self.repo),
            "--servable",
            self.servable,
            "--rank",
            str(rank),
            "--cache-dir",
            str(self.tmp / f"cache-r{rank}"),
            "--heartbeat-interval",
            "0.3",
            "--drain-seconds",
            "5",
            *extra,
        ]
        agent = AgentProcess(self.amqp_url, log, args)
        self.started.append(agent)
        return agent

    def kill_all(self) -> None:
        for agent in self.started:
            agent.kill()


@pytest.fixture
def agents(isolated_amqp_url: str, scheduler: FakeScheduler, tmp_path: Path) -> Any:
    repo = tmp_path / "repo"
    export_matmul(repo, rank_size=2, strategy="column", name=scheduler.servable)
    started = Agents(isolated_amqp_url, repo, tmp_path, scheduler.servable)
    yield started
    started.kill_all()


async def test_two_ranks_run_a_job_then_stop_cleanly(
    scheduler: FakeScheduler, agents: Agents
) -> None:
    # rank 1 runs under a memory cap, to show a capped agent serves (see --max-memory-mb help)
    procs = [agents.start(0), agents.start(1, "--max-memory-mb", "400")]
    hellos = [await scheduler.register(0), await scheduler.register(1)]
    assert {h.cache for h in hellos} == {"miss"}
    assert hellos[0].slice_checksum != hellos[1].slice_checksum

    await scheduler.send_work("job-1")
    results = await scheduler.collect(1)
    # the stage ends in an allgather, combined at the leader: only rank 0 answers
    assert set(results) == {0} and results[0].error is None, results
    assert results[0].outputs is not None
    y = results[0].outputs["y"].to_numpy()
    expected = -(np.ones((128, 96), np.float32) @ np.full((96, 16), 0.5, np.float32))
    np.testing.assert_array_equal(y, expected)
    assert results[0].digest == digest_tensors(results[0].outputs)
    for rank in (0, 1):
        async with asyncio.timeout(WAIT):  # heartbeats carry the work metrics
            while (beat := await scheduler.next(AgentHeartbeat, rank)).jobs_done == 0:
                pass
        assert beat.jobs_done == 1 and beat.compute_ms_total > 0
        assert beat.collective_ms_total > 0  # both ranks took part in the allgather
    await scheduler.next(AgentHeartbeat, 1)  # a beat later: rank 1 ran the job, sent nothing
    assert scheduler.results.empty()

    for proc in procs:
        proc.proc.send_signal(signal.SIGTERM)
    assert [await p.wait(5 + 10) for p in procs] == [0, 0]
    byes = {(await scheduler.next(AgentBye)).rank for _ in procs}
    assert byes == {0, 1}
    assert "req=job-1" in procs[0].text()  # log lines carry the job id

    again = agents.start(0)
    hello = await scheduler.next(AgentHello, 0)
    assert hello.cache == "hit"
    assert "compile cache hit" in again.text()
    await scheduler.verdict(hello, accepted=False, reason="test over")
    assert await again.wait() == 3


async def test_refused_agent_exits_3_and_says_why(scheduler: FakeScheduler, agents: Agents) -> None:
    agent = agents.start(1, "--no-cache")
    hello = await scheduler.next(AgentHello, 1)
    assert hello.cache == "off"
    await scheduler.verdict(hello, accepted=False, reason="rank 1 is already served by agent x")
    assert await agent.wait() == 3
    assert "rank 1 is already served by agent x" in agent.text()
    assert " ERROR " in agent.text()


async def test_hello_is_repeated_until_a_scheduler_answers(
    scheduler: FakeScheduler, agents: Agents
) -> None:
    agent = agents.start(0, "--no-cache")
    first = await scheduler.next(AgentHello, 0)
    second = await scheduler.next(AgentHello, 0)
    assert first.instance == second.instance
    await scheduler.verdict(second, accepted=False, reason="done")
    assert await agent.wait() == 3


async def test_missing_peer_fails_the_job_at_its_deadline(
    scheduler: FakeScheduler, agents: Agents
) -> None:
    agent = agents.start(0, "--no-cache")
    await scheduler.register(0)
    await scheduler.send_work("lonely", deadline_s=1.0)
    result = (await scheduler.collect(1))[0]
    assert result.error is not None and result.error.code == ErrorCode.DEADLINE
    assert "rank(s) 1" in result.error.message
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait() == 0


async def test_job_cancel_aborts_a_waiting_job(scheduler: FakeScheduler, agents: Agents) -> None:
    agent = agents.start(0, "--no-cache")
    await scheduler.register(0)
    await scheduler.send_work("doomed", deadline_s=30.0)
    await scheduler.waiting_for_peers(0)
    cancel = JobCancel(job="doomed", servable=scheduler.servable, version=1, reason="rank 1 lost")
    await scheduler.broker.publish(CONTROL_EXCHANGE, group_key(scheduler.servable, 1), cancel)
    agent.proc.send_signal(signal.SIGTERM)  # drain must not wait 30 s for the dead job
    assert await agent.wait(10) == 0
    assert "rank 1 lost" in agent.text()
    assert scheduler.results.empty()


async def test_memory_cap_too_small_exits_1_with_a_clear_message(
    scheduler: FakeScheduler, agents: Agents
) -> None:
    agent = agents.start(0, "--no-cache", "--max-memory-mb", "64")
    assert await agent.wait() == 1
    assert "exceeds the memory cap of 64 MB" in agent.text()


async def test_sigterm_finishes_the_job_in_flight(scheduler: FakeScheduler, agents: Agents) -> None:
    agent = agents.start(0, "--no-cache")
    await scheduler.register(0)
    await scheduler.send_work("in-flight", deadline_s=30.0)
    await scheduler.waiting_for_peers(0)
    agent.proc.send_signal(signal.SIGTERM)
    await scheduler.beat(0, "draining", 1)  # draining, the job still in flight
    assert agent.proc.poll() is None, agent.text()
    part = CollectivePart(
        job="in-flight",
        stage=0,
        step=0,
        rank=1,
        tensor=Tensor.from_numpy(np.full((128, 8), -48.0, dtype=np.float32)),
    )
    await scheduler.broker.publish(COLLECTIVE_EXCHANGE, stage_key(scheduler.servable, 1, 0), part)
    result = (await scheduler.collect(1))[0]
    assert result.error is None and result.outputs is not None
    assert np.all(result.outputs["y"].to_numpy() == -48.0)
    assert await agent.wait(10) == 0
    assert (await scheduler.next(AgentBye, 0)).state == "draining"


async def test_new_scheduler_gets_a_new_hello_and_may_refuse(
    scheduler: FakeScheduler, agents: Agents
) -> None:
    agent = agents.start(0, "--no-cache")
    first = await scheduler.register(0)
    hello = SchedulerHello(scheduler="replacement")
    await scheduler.broker.publish(CONTROL_EXCHANGE, KEY_SCHEDULER_HELLO, hello)
    again = await scheduler.next(AgentHello, 0)
    assert again.instance == first.instance
    await scheduler.verdict(again, accepted=False, reason="rank 0 now served elsewhere")
    assert await agent.wait() == 3
    assert "rank 0 now served elsewhere" in agent.text()
