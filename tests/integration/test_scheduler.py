"""The scheduler process against real RabbitMQ, with two fake agents in the test process.

The fake agents speak the wire protocol exactly as agents do (hello, verdict, heartbeats,
StageWork -> StageResult); what they compute is y = -x, so the reply proves the data went
through the scheduler, the stage exchange, the ranks and back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardserve_scheduler
from shardserve.amqp.broker import Broker
from shardserve.errors import ErrorCode
from shardserve.process.settings import BrokerSettings
from shardserve.repo.repository import (
    GroupConfig,
    RankSpec,
    RunOp,
    StageSpec,
    rank_checksum,
    write_group,
)
from shardserve.wire import topology
from shardserve.wire.protocol import (
    AgentHeartbeat,
    AgentHello,
    InferReply,
    InferRequest,
    MeshStatus,
    Message,
    RegistrationVerdict,
    SchedulerHello,
    StageResult,
    StageWork,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor, digest_tensors

pytestmark = pytest.mark.integration

WAIT = 30.0


def _files(rank: int) -> dict[str, str]:
    return {"seg.onnx": f"{rank + 1:064x}"}


def tiny_group(servable: str) -> GroupConfig:
    spec_in = TensorSpec(name="x", datatype="FP32", shape=(2, 3))
    spec_out = TensorSpec(name="y", datatype="FP32", shape=(2, 3))
    stage = StageSpec(
        index=0, ranks=(0, 1), inputs=("x",), outputs=("y",), program=(RunOp(file="seg.onnx"),)
    )
    ranks = tuple(
        RankSpec(rank=r, stage=0, files=_files(r), checksum=rank_checksum(_files(r)))
        for r in (0, 1)
    )
    return GroupConfig(
        servable=servable,
        version=1,
        rank_size=2,
        stage_size=1,
        inputs=(spec_in,),
        outputs=(spec_out,),
        stages=(stage,),
        ranks=ranks,
    )


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    suffix = uuid.uuid4().hex[:6]
    return {"served": f"tiny{suffix}", "lonely": f"lonely{suffix}"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, names: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for servable in names.values():
        folder = root / servable / "1"
        folder.mkdir(parents=True)
        write_group(folder, tiny_group(servable))
    return root


@pytest.fixture(scope="module")
def scheduler(
    repo: Path, isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    log_path = tmp_path_factory.mktemp("sched") / "scheduler.log"
    src = str(Path(shardserve_scheduler.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "SHARDSERVE_AMQP_URL": isolated_amqp_url,
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
        "SHARDSERVE_LOG_LEVEL": "DEBUG",
    }
    args = [
        sys.executable,
        "-m",
        "shardserve_scheduler",
        "--repository",
        str(repo),
        "--heartbeat-timeout",
        "2",
        "--status-interval",
        "0.3",
    ]
    with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


class FakeMesh:
    """Two fake agents of one servable, a reply queue and a status queue, on one Broker."""

    def __init__(self, url: str, servable: str) -> None:
        self.broker = Broker(BrokerSettings(urls=(url,)), f"fake-agents-{uuid.uuid4().hex[:6]}")
        self.servable = servable
        self.owner = uuid.uuid4().hex[:8]
        self.inbox: dict[str, asyncio.Queue[Message]] = {}
        self.replies: asyncio.Queue[tuple[str | None, InferReply]] = asyncio.Queue()
        self.statuses: asyncio.Queue[MeshStatus] = asyncio.Queue()
        self.work_seen = 0
        self.silent: set[int] = set()  # ranks that stopped heartbeating and answering

    async def start(self) -> None:
        await self.broker.connect()
        for rank in (0, 1):
            await self._declare_agent(rank)
        await self.add_instance("intruder")
        reply_q = topology.reply_queue(self.owner)
        await self.broker.declare(reply_q)
        await self.broker.consume(reply_q.name, self._on_reply, prefetch=16)
        status_q = topology.status_queue(self.owner)
        await self.broker.declare(status_q, topology.status_bindings(self.owner))
        await self.broker.consume(status_q.name, self._on_status, prefetch=16)

    def instance(self, rank: int) -> str:
        return f"{self.owner}-r{rank}"

    async def add_instance(self, instance: str) -> None:
        control = topology.agent_control_queue(instance)
        bindings = (
            topology.Binding(control.name, topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_HELLO),
            topology.Binding(
                control.name, topology.CONTROL_EXCHANGE, topology.agent_control_key(instance)
            ),
        )
        await self.broker.declare(control, bindings)
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.inbox[instance] = inbox

        async def on_control(message: Message, _: Any) -> None:
            await inbox.put(message)

        await self.broker.consume(control.name, on_control, prefetch=16)

    async def _declare_agent(self, rank: int) -> None:
        instance = self.instance(rank)
        await self.add_instance(instance)
        bindings = topology.agent_bindings(self.servable, 1, rank, 0, instance)
        work_q = topology.agent_work_queue(self.servable, 1, rank)
        await self.broker.declare(work_q, bindings)

        async def on_work(message: Message, _: Any) -> None:
            assert isinstance(message, StageWork)
            await self._answer(rank, message)

        await self.broker.consume(work_q.name, on_work, prefetch=16)

    async def _answer(self, rank: int, work: StageWork) -> None:
        self.work_seen += 1
        if rank in self.silent:
            return
        assert work.digest == digest_tensors(work.inputs)
        outputs = {"y": Tensor.from_numpy(-work.inputs["x"].to_numpy())}
        result = StageResult(
            job=work.job,
            servable=work.servable,
            version=work.version,
            stage=work.stage,
            rank=rank,
            digest=digest_tensors(outputs),
            outputs=outputs if rank == 0 else None,
        )
        await self.broker.publish("", work.result_to, result)

    async def _on_reply(self, message: Message, incoming: Any) -> None:
        assert isinstance(message, InferReply)
        await self.replies.put((incoming.correlation_id, message))

    async def _on_status(self, message: Message, _: Any) -> None:
        if isinstance(message, MeshStatus):
            await self.statuses.put(message)

    def agent_state(self, rank: int, instance: str | None = None) -> dict[str, Any]:
        return dict(
            instance=instance or self.instance(rank),
            servable=self.servable,
            version=1,
            rank=rank,
            stage=0,
            slice_checksum=rank_checksum(_files(rank)),
            host="testhost",
            pid=4242 + rank,
        )

    async def hello(self, rank: int, instance: str | None = None) -> RegistrationVerdict:
        state = self.agent_state(rank, instance)
        await self.broker.publish(
            topology.CONTROL_EXCHANGE, topology.KEY_AGENT_HELLO, AgentHello(**state)
        )
        return await self.next_of(state["instance"], RegistrationVerdict)

    async def heartbeats(self) -> None:
        while True:
            for rank in sorted({0, 1} - self.silent):
                beat = AgentHeartbeat(**self.agent_state(rank))
                await self.broker.publish(
                    topology.CONTROL_EXCHANGE, topology.KEY_AGENT_HEARTBEAT, beat
                )
            await asyncio.sleep(0.3)

    async def next_of(self, instance: str, kind: type[Any]) -> Any:
        async with asyncio.timeout(WAIT):
            while True:
                message = await self.inbox[instance].get()
                if isinstance(message, kind):
                    return message

    async def infer(self, request: InferRequest) -> InferReply:
        correlation = uuid.uuid4().hex
        await self.broker.publish(
            topology.REQUESTS_EXCHANGE,
            request.servable,
            request,
            correlation_id=correlation,
            reply_to=topology.reply_queue(self.owner).name,
            confirm=True,
        )
        async with asyncio.timeout(WAIT):
            got, reply = await self.replies.get()
        assert got == correlation
        return reply

    async def wait_status(self, servable: str, ready: bool, since: float = 0.0) -> MeshStatus:
        """The first status (sent after ``since``) in which ``servable`` has this readiness."""
        async with asyncio.timeout(WAIT):
            while True:
                status = await self.statuses.get()
                if status.time < since:
                    continue
                for s in status.servables:
                    if s.name == servable and s.ready == ready:
                        return status


@pytest.fixture
async def mesh(
    scheduler: subprocess.Popen[bytes], isolated_amqp_url: str, names: dict[str, str]
) -> AsyncIterator[FakeMesh]:
    fake = FakeMesh(isolated_amqp_url, names["served"])
    await fake.start()
    try:
        yield fake
    finally:
        await fake.broker.close()


def request(servable: str, x: np.ndarray, rid: str = "user-1") -> InferRequest:
    return InferRequest(
        id=rid,
        servable=servable,
        instances=({"x": Tensor.from_numpy(x)},),
        deadline=time.time() + WAIT,
    )


async def test_scheduler_serves_through_fake_agents(
    mesh: FakeMesh, scheduler: subprocess.Popen[bytes], names: dict[str, str]
) -> None:
    # A scheduler says hello when it starts: wait for it, so our hellos reach a consumer.
    await mesh.next_of(mesh.instance(0), SchedulerHello)
    for rank in (0, 1):
        verdict = await mesh.hello(rank)
        assert verdict.accepted, verdict.reason
    async with asyncio.TaskGroup() as tasks:
        beats = tasks.create_task(mesh.heartbeats())
        try:
            await _exercise(mesh, names)
        finally:
            beats.cancel()
    scheduler.send_signal(signal.SIGTERM)
    assert scheduler.wait(30) == 0


async def _exercise(mesh: FakeMesh, names: dict[str, str]) -> None:
    status = await mesh.wait_status(names["served"], ready=True)
    served = next(s for s in status.servables if s.name == names["served"])
    assert [m.name for m in served.methods] == ["predict"]
    assert {r.pid for r in served.ranks} == {4242, 4243}

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    reply = await mesh.infer(request(names["served"], x))
    assert reply.error is None, reply.error
    assert reply.id == "user-1" and reply.version == 1
    outputs = reply.instances[0].outputs
    assert outputs is not None
    np.testing.assert_array_equal(outputs["y"].to_numpy(), -x)

    verdict = await mesh.hello(1, "intruder")
    assert not verdict.accepted
    assert f"already served by instance {mesh.instance(1)}" in verdict.reason
    assert "host testhost, pid 4243" in verdict.reason

    reply = await mesh.infer(request(names["lonely"], x))
    assert reply.error is not None and reply.error.code == ErrorCode.UNAVAILABLE
    assert reply.error.message == f"{names['lonely']} v1 is not ready: ranks 0, 1 missing"

    bad = request(names["served"], np.ones((4, 4), np.float32))
    reply = await mesh.infer(bad)
    assert reply.error is not None and reply.error.code == ErrorCode.BAD_INPUT
    assert mesh.work_seen == 2  # the bad and the unready requests never reached a rank

    # Rank 1 goes silent: the request in flight fails RANK_LOST once the heartbeat times out.
    mesh.silent.add(1)
    reply = await mesh.infer(request(names["served"], x, rid="user-2"))
    assert reply.error is not None and reply.error.code == ErrorCode.RANK_LOST, reply.error
    assert reply.error.message == f"{names['served']} v1 lost rank 1 (no heartbeat for 2 s)"
    # It comes back (heartbeats resume): the group heals and serves again.
    mesh.silent.clear()
    await mesh.wait_status(names["served"], ready=True, since=time.time())
    reply = await mesh.infer(request(names["served"], x, rid="user-3"))
    assert reply.error is None, reply.error
