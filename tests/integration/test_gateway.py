"""The gateway process against real RabbitMQ, with a fake scheduler in the test process.

The test binds its own temporary queue to the requests exchange under unique servable
names (on its own vhost) and publishes MeshStatus itself, so the gateway is exercised
end to end without a scheduler or agents: HTTP -> AMQP request -> reply -> HTTP.
tritonclient (the aio flavour, so the fake scheduler keeps running on this loop) drives
binary and JSON inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
import rabbitctl
import tritonclient.http.aio as triton_aio
from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.process.settings import AMQP_URL_ENV, BrokerSettings
from shardserve.wire import topology
from shardserve.wire.protocol import (
    InferReply,
    InferRequest,
    InferRequestBundle,
    InstanceResult,
    MeshStatus,
    Message,
    MethodStatus,
    ServableStatus,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
GATEWAY_ID = f"gwtest-{uuid.uuid4().hex[:10]}"  # also its broker connection's name
RECONNECT_INTERVAL_S = 3.0  # a broker outage of the gateway lasts at least this long
WEIGHT = np.full((96, 16), 0.5, dtype=np.float32)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def start_gateway(amqp_url: str, log: Path, *extra: str) -> GatewayProcess:
    """A gateway process on a free HTTP port (``extra``: more of its arguments), once live."""
    port = free_port()
    env = {
        **os.environ,
        AMQP_URL_ENV: amqp_url,
        "SHARDSERVE_AMQP_RECONNECT_INTERVAL": str(RECONNECT_INTERVAL_S),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT / "services/gateway/src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    args = [sys.executable, "-m", "shardserve_gateway", "--http-port", str(port)]
    args += ["--default-timeout", "10", "--drain-seconds", "5", "--gateway-id", GATEWAY_ID]
    with log.open("wb") as out:
        proc = subprocess.Popen([*args, *extra], env=env, stdout=out, stderr=subprocess.STDOUT)
    gw = GatewayProcess(proc, port, log)
    _wait_live(gw)
    return gw


def stop_gateway(gw: GatewayProcess) -> None:
    """SIGTERM; it must exit 0 within 30 s."""
    gw.proc.send_signal(signal.SIGTERM)
    try:
        code = gw.proc.wait(30)
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        gw.proc.wait(10)
        raise AssertionError(f"gateway did not stop on SIGTERM:\n{gw.log_tail()}") from None
    assert code == 0, gw.log_tail()


@pytest.fixture(scope="module")
def gateway_process(
    isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    gw = start_gateway(isolated_amqp_url, log, "--grpc-port", "0")
    yield gw
    stop_gateway(gw)


def _wait_live(gw: GatewayProcess, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            raise AssertionError(f"gateway exited with {gw.proc.returncode}:\n{gw.log_tail()}")
        try:
            with urllib.request.urlopen(f"{gw.url}/v2/health/live", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"gateway not live after {timeout}s:\n{gw.log_tail()}")


def spec(name: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name=name, datatype="FP32", shape=shape)


def servable_status(name: str) -> ServableStatus:
    method = MethodStatus(
        name="predict", inputs=(spec("x", (128, 96)),), outputs=(spec("y", (128, 16)),)
    )
    return ServableStatus(
        name=name, version=1, ready=True, rank_size=1, stage_size=1, methods=(method,), ranks=()
    )


@dataclass
class FakeScheduler:
    """Answers requests for ``servable``; never answers requests for ``silent``."""

    broker: Broker
    servable: str
    silent: str
    received: list[InferRequest] = field(default_factory=list)
    silent_received: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_request(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        assert incoming.reply_to is not None
        if isinstance(message, InferRequestBundle):  # the gateway's group commit
            for item in message.requests:
                await self.answer(item.request, incoming.reply_to, item.correlation_id)
        elif isinstance(message, InferRequest):
            await self.answer(message, incoming.reply_to, incoming.correlation_id)

    async def answer(
        self, message: InferRequest, reply_to: str, correlation_id: str | None
    ) -> None:
        self.received.append(message)
        if message.servable == self.silent:
            self.silent_received.set()
            return
        results = tuple(
            InstanceResult(outputs={"y": Tensor.from_numpy(-(i["x"].to_numpy() @ WEIGHT))})
            for i in message.instances
        )
        reply = InferReply(
            id=message.id,
            servable=message.servable,
            version=1,
            method=message.method,
            instances=results,
        )
        await self.broker.publish("", reply_to, reply, correlation_id=correlation_id)

    async def broadcast_status(self) -> None:
        servables = (servable_status(self.servable), servable_status(self.silent))
        while True:  # each status stamped when sent: a test can tell a later one apart
            status = MeshStatus(scheduler="fake", time=time.time(), servables=servables)
            await self.broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS, status
            )
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def fake_scheduler(amqp_url: str, gw: GatewayProcess) -> AsyncIterator[FakeScheduler]:
    """A FakeScheduler of fresh servable names, once ``gw`` knows them."""
    broker = Broker(BrokerSettings(urls=(amqp_url,)), name="fake-scheduler")
    await broker.connect()
    tag = uuid.uuid4().hex[:8]
    fake = FakeScheduler(broker, f"gwtest-{tag}", f"gwtest-{tag}-silent")
    queue = topology.Queue(f"gwtest.requests.{tag}", exclusive=True, auto_delete=True)
    bindings = tuple(
        topology.Binding(queue.name, topology.REQUESTS_EXCHANGE, key)
        for key in (fake.servable, fake.silent)
    )
    await broker.declare(queue, bindings)
    await broker.consume(queue.name, fake.on_request, prefetch=16)
    status_task = asyncio.create_task(fake.broadcast_status())
    try:
        await _wait_ready(gw, fake.servable)
        yield fake
    finally:
        status_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await status_task
        await broker.close()


@pytest.fixture
async def scheduler(
    isolated_amqp_url: str, gateway_process: GatewayProcess
) -> AsyncIterator[FakeScheduler]:
    async with fake_scheduler(isolated_amqp_url, gateway_process) as fake:
        yield fake


async def _wait_ready(gw: GatewayProcess, servable: str, within_s: float = 30.0) -> None:
    """Until the gateway is ready and knows this test's servable: the gateway outlives each
    test's fake scheduler, so it can be ready on the previous one's status first."""
    paths = ("/v2/health/ready", f"/v2/models/{servable}/ready")
    async with aiohttp.ClientSession() as session, asyncio.timeout(within_s):
        while True:  # polling: the gateway offers no event to wait on from outside
            if await _all_ok(session, [gw.url + path for path in paths]):
                return
            await asyncio.sleep(0.1)


async def _all_ok(session: aiohttp.ClientSession, urls: list[str]) -> bool:
    for url in urls:
        async with session.get(url) as resp:
            if resp.status != 200:
                return False
    return True


async def test_binary_infer_through_tritonclient(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    client = triton_aio.InferenceServerClient(f"127.0.0.1:{gateway_process.port}")
    try:
        assert await client.is_server_ready()
        meta = await client.get_model_metadata(scheduler.servable)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [128, 96]}]
        x = np.random.default_rng(0).standard_normal((128, 96)).astype(np.float32)
        inp = triton_aio.InferInput("x", [128, 96], "FP32")
        inp.set_data_from_numpy(x)  # binary by default
        out = triton_aio.InferRequestedOutput("y")  # binary by default
        result = await client.infer(scheduler.servable, [inp], outputs=[out], request_id="r1")
        np.testing.assert_array_equal(result.as_numpy("y"), -(x @ WEIGHT))
        assert result.get_response()["id"] == "r1"
    finally:
        await client.close()
    assert scheduler.received[-1].servable == scheduler.servable


async def test_json_infer_through_tritonclient(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    client = triton_aio.InferenceServerClient(f"127.0.0.1:{gateway_process.port}")
    try:
        inp = triton_aio.InferInput("x", [128, 96], "FP32")
        inp.set_data_from_numpy(np.ones((128, 96), np.float32), binary_data=False)
        out = triton_aio.InferRequestedOutput("y", binary_data=False)
        result = await client.infer(scheduler.servable, [inp], outputs=[out])
        assert (result.as_numpy("y") == -48.0).all()
        assert "binary_data_size" not in str(result.get_response())
    finally:
        await client.close()


async def test_bad_input_is_400_and_never_published(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    body = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    async with aiohttp.ClientSession() as session:
        url = f"{gateway_process.url}/v2/models/{scheduler.servable}/infer"
        async with session.post(url, json=body) as resp:
            assert resp.status == 400
            assert resp.headers["Content-Type"] == "application/json"
            assert "has shape [2], expected [128, 96]" in (await resp.json())["error"]
    assert scheduler.received == []


async def test_no_reply_gives_504_at_the_deadline(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    body = {
        "inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}]
    }
    url = f"{gateway_process.url}/v2/models/{scheduler.silent}/infer"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(url, json=body, headers={"X-Request-Timeout": "1.0"}) as resp:
            elapsed = time.monotonic() - started
            assert resp.status == 504
            assert "deadline exceeded" in (await resp.json())["error"]
    # The deadline is honoured: not answered before it (the scheduler got the request)...
    assert elapsed >= 1.0
    assert scheduler.received[-1].servable == scheduler.silent
    assert scheduler.received[-1].deadline - time.time() < 0


async def test_mindspore_rest_and_status(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    async with aiohttp.ClientSession() as session:
        url = f"{gateway_process.url}/model/{scheduler.servable}:predict"
        body = {"instances": [{"x": [[1.0] * 96] * 128}, {"x": [[2] * 96] * 128}]}
        async with session.post(url, json=body) as resp:
            assert resp.status == 200
            reply = await resp.json()
        assert reply["instances"][0]["y"][0][0] == -48.0
        assert reply["instances"][1]["y"][0][0] == -96.0
        async with session.get(f"{gateway_process.url}/api/status") as resp:
            status = await resp.json()
        assert status["fresh"] is True
        assert {s["name"] for s in status["servables"]} >= {scheduler.servable}


# ---------------------------------------------------------------- broker outage


def _gateway_connection_pids() -> list[str]:
    pids = rabbitctl.connection_pids(GATEWAY_ID)
    assert pids, f"no broker connection named {GATEWAY_ID}"
    return pids


def _close_connections(pids: list[str]) -> None:
    """Force-close the gateway's AMQP connection, as a broker restart or a network cut does."""
    for pid in pids:
        subprocess.run(
            ["rabbitmqctl", "-q", "close_connection", pid, "test: simulated outage"],
            check=True,
            capture_output=True,
            timeout=60,
        )


async def _post_infer(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0
) -> tuple[int, dict[str, str]]:
    body = {
        "inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}]
    }
    headers = {"X-Request-Timeout": str(timeout_s)}
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_broker_outage_fails_fast_then_recovers(
    scheduler: FakeScheduler, gateway_process: GatewayProcess
) -> None:
    base = gateway_process.url
    async with aiohttp.ClientSession() as session:
        # A request the (fake) scheduler never answers is in flight when the connection dies.
        pending = asyncio.create_task(
            _post_infer(session, f"{base}/v2/models/{scheduler.silent}/infer", timeout_s=60)
        )
        await asyncio.wait_for(scheduler.silent_received.wait(), 10)
        pids = await asyncio.to_thread(_gateway_connection_pids)
        closing = asyncio.create_task(asyncio.to_thread(_close_connections, pids))
        status, body = await pending
        # Failed by the lost connection, not at its 60 s deadline (that would be a 504).
        assert status == 503, body
        assert "broker connection lost" in body["error"]
        assert body["code"] == "unavailable"
        # During the outage: not ready, and new requests get 503 at once.
        async with session.get(f"{base}/v2/health/ready") as resp:
            assert resp.status == 503
            assert "message broker is unreachable" in (await resp.json())["error"]
        status, body = await _post_infer(session, f"{base}/v2/models/{scheduler.servable}/infer")
        assert (status, body["error"]) == (503, "message broker is unreachable")
        await closing
        # After the robust connection is back, replies and status broadcasts flow again.
        await _wait_ready(gateway_process, scheduler.servable)
        status, body = await _post_infer(session, f"{base}/v2/models/{scheduler.servable}/infer")
        assert status == 200, body
        await _wait_status_sent_after(session, base, time.time())


async def _wait_status_sent_after(
    session: aiohttp.ClientSession, base: str, moment: float, within_s: float = 30.0
) -> None:
    """Until the gateway shows a status the fake scheduler sent after ``moment``: status
    broadcasts flow again (the gateway offers no event to wait on from outside)."""
    async with asyncio.timeout(within_s):
        while True:
            async with session.get(f"{base}/api/status") as resp:
                if (await resp.json()).get("time", 0.0) > moment:
                    return
            await asyncio.sleep(0.1)


async def test_sigterm_drains_grpc_calls_then_ends_the_rest_unavailable(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """On SIGTERM the gRPC port stops taking work (UNAVAILABLE with retry-after), gives the
    calls in flight the drain, then ends them UNAVAILABLE (not a reset) and the gateway
    exits 0."""
    grpc_port = free_port()
    gw = start_gateway(
        isolated_amqp_url,
        tmp_path / "gateway.log",
        "--grpc-port",
        str(grpc_port),
        "--drain-seconds",
        "2",
        "--gateway-id",  # the last one counts: the module's gateway holds the first
        f"{GATEWAY_ID}-drain",
    )
    try:
        async with (
            fake_scheduler(isolated_amqp_url, gw) as fake,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ):
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            pending = asyncio.ensure_future(infer(_matmul_request(fake.silent), timeout=60))
            await asyncio.wait_for(fake.silent_received.wait(), 30)
            stopped_at = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            refused = await _first_refusal(infer, _matmul_request(fake.servable))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert ("retry-after", "1") in tuple(refused.trailing_metadata() or ())
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await pending
            waited = time.monotonic() - stopped_at
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert "shutting down" in (ended.value.details() or "")
        assert waited >= 1.5, f"the call in flight was ended after {waited:.2f} s, not drained"
        assert gw.proc.wait(30) == 0, gw.log_tail()
    finally:
        if gw.proc.poll() is None:
            stop_gateway(gw)


def _matmul_request(servable: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=servable)
    request.inputs.add(name="x", datatype="FP32", shape=[128, 96])
    request.raw_input_contents.append(np.ones((128, 96), np.float32).tobytes())
    return request


async def _first_refusal(
    infer: grpc.aio.UnaryUnaryMultiCallable, request: pb.ModelInferRequest
) -> grpc.aio.AioRpcError:
    """Calls until the draining gateway refuses one (each answered one is right)."""
    async with asyncio.timeout(10):
        while True:
            try:
                response = await infer(request, timeout=10)
            except grpc.aio.AioRpcError as refused:
                return refused
            assert response.outputs[0].name == "y"
