"""TLS everywhere: amqps between every service and the broker, https at the gateway.

The test makes its own certificates (``scripts/make-test-certs``: a CA, a server
certificate for 127.0.0.1/localhost, a client certificate, plus an unrelated second CA
with its own client certificate) and starts a private RabbitMQ node
(``shardserve.ops.rabbitnode``: own node name, ports and folders) whose TLS listener demands
a client certificate signed by the test CA (``verify_peer`` + ``fail_if_no_peer_cert``).
Services reach it with ``amqps://...?cafile=...&certfile=...&keyfile=...`` (aiormq's
URL parameters). Skipped only when such a node cannot be started here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest

from shardserve.ops import rabbitnode
from shardserve.ops.rabbitnode import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
ONES = {"inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}]}


def _node_port() -> int:
    candidates = list(range(6000, 6200))
    random.shuffle(candidates)  # parallel runs rarely race for the same port
    for port in candidates:
        if rabbitnode.port_pair_free(port):
            return port
    pytest.skip("no free port pair in 6000-6199 (+20000) for the TLS RabbitMQ node")


def make_certs(folder: Path) -> Path:
    subprocess.run([str(SCRIPTS / "make-test-certs"), str(folder)], check=True, capture_output=True)
    return folder


@dataclass(frozen=True)
class TlsBroker:
    """A private RabbitMQ node with a TLS listener that requires client certificates."""

    ssl_port: int
    certs: Path  # the CA the node trusts, its server certificate, a good client's
    foreign: Path  # another CA and a client certificate signed by it

    def url(self, certs: Path | None = None, *, client: bool = True) -> str:
        certs = certs or self.certs
        query = f"cafile={self.certs / 'ca.pem'}"
        if client:
            query += f"&certfile={certs / 'client.pem'}&keyfile={certs / 'client.key'}"
        return f"amqps://guest:guest@127.0.0.1:{self.ssl_port}/?{query}"


def _tls_config(certs: Path, ssl_port: int) -> str:
    return "\n".join(
        [
            f"listeners.ssl.default = 127.0.0.1:{ssl_port}",
            f"ssl_options.cacertfile = {certs / 'ca.pem'}",
            f"ssl_options.certfile = {certs / 'server.pem'}",
            f"ssl_options.keyfile = {certs / 'server.key'}",
            "ssl_options.verify = verify_peer",
            "ssl_options.fail_if_no_peer_cert = true",
        ]
    )


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TlsBroker, Any]]:
    reason = rabbitnode.rabbit_available()
    if reason:
        pytest.skip(f"cannot start a TLS RabbitMQ node: {reason}")
    work = tmp_path_factory.mktemp("tls")
    broker = TlsBroker(free_port(), make_certs(work / "certs"), make_certs(work / "foreign"))
    # The plain listener stays on its own free port: rabbitmqctl needs none, services
    # are never given it.
    node = rabbitnode.RabbitNode(
        work / "nodes",
        f"sstls-{uuid.uuid4().hex[:8]}",
        _node_port(),
        extra_config=_tls_config(broker.certs, broker.ssl_port),
    )
    try:
        node.start()
    except (rabbitnode.NodeError, OSError, subprocess.SubprocessError) as exc:
        node.kill()
        pytest.skip(f"cannot start a TLS RabbitMQ node: {exc}")
    try:
        yield broker, node
    finally:
        node.stop()
        node.kill()


@pytest.fixture(scope="module")
def tls_broker(tls_node: tuple[TlsBroker, Any]) -> TlsBroker:
    return tls_node[0]


async def _connect(url: str) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    await connection.close()


async def test_broker_accepts_only_clients_of_its_ca(tls_broker: TlsBroker) -> None:
    await _connect(tls_broker.url())  # the good client: the control that makes the rest mean
    with pytest.raises((ConnectionError, aio_pika.exceptions.AMQPError, ssl.SSLError)):
        await _connect(tls_broker.url(tls_broker.foreign))
    with pytest.raises((ConnectionError, aio_pika.exceptions.AMQPError, ssl.SSLError)):
        await _connect(tls_broker.url(client=False))


async def test_client_refuses_a_broker_it_does_not_trust(tls_broker: TlsBroker) -> None:
    foreign = tls_broker.foreign
    url = (
        f"amqps://guest:guest@127.0.0.1:{tls_broker.ssl_port}/?cafile={foreign / 'ca.pem'}"
        f"&certfile={tls_broker.certs / 'client.pem'}&keyfile={tls_broker.certs / 'client.key'}"
    )
    with pytest.raises((ssl.SSLCertVerificationError, aio_pika.exceptions.AMQPError)):
        await _connect(url)


# ---------------------------------------------------------------- a mesh over amqps


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> Process:
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Process(proc, log)


@dataclass(frozen=True)
class TlsMesh:
    broker: TlsBroker
    node: Any
    http_url: str  # the plain gateway that `shardserve up` started
    https_url: str  # a second gateway, started directly with --tls-cert/--tls-key


def _client_ssl(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


async def _ready(url: str, context: ssl.SSLContext | bool, proc: Process, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert proc.proc.poll() is None, f"process exited:\n{proc.tail()}"
            try:
                async with session.get(url + "/v2/health/ready", ssl=context) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.3)
    raise AssertionError(f"{url} not ready after {within_s:g}s:\n{proc.tail()}")


@pytest.fixture(scope="module")
def tls_mesh(
    tls_node: tuple[TlsBroker, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsMesh]:
    broker, node = tls_node
    work = tmp_path_factory.mktemp("tlsmesh")
    repo = work / "repo"
    subprocess.run(
        [SHARDSERVE, "export", "matmul", "--rank-size", "2", "--out", str(repo)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "SHARDSERVE_AMQP_URL": broker.url(), "PYTHONUNBUFFERED": "1"}
    http_port, https_port = free_port(), free_port()
    up = [SHARDSERVE, "up", str(repo), "--http-port", str(http_port), "--grace-seconds", "5"]
    mesh = _spawn(up, env, work / "mesh.log")
    gateway_argv = [
        sys.executable,
        "-m",
        "shardserve_gateway",
        "--http-port",
        str(https_port),
        "--tls-cert",
        str(broker.certs / "server.pem"),
        "--tls-key",
        str(broker.certs / "server.key"),
    ]
    gateway = _spawn(gateway_argv, env, work / "gateway.log")
    try:
        http_url = f"http://127.0.0.1:{http_port}"
        https_url = f"https://127.0.0.1:{https_port}"
        asyncio.run(_ready(http_url, True, mesh, 180))
        asyncio.run(_ready(https_url, _client_ssl(broker.certs / "ca.pem"), gateway, 60))
        yield TlsMesh(broker, node, http_url, https_url)
    finally:
        gateway.stop()
        mesh.stop()


async def _infer(url: str, context: ssl.SSLContext | bool = True) -> list[float]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v2/models/matmul/infer", json=ONES, ssl=context) as r,
    ):
        body = await r.json(content_type=None)
        assert r.status == 200, body
    (y,) = [o for o in body["outputs"] if o["name"] == "y"]
    assert y["shape"] == [128, 16]
    return list(y["data"])


async def test_mesh_answers_over_amqps(tls_mesh: TlsMesh) -> None:
    assert set(await _infer(tls_mesh.http_url)) == {-48.0}


def test_every_mesh_connection_is_tls(tls_mesh: TlsMesh) -> None:
    """The node sees only TLS connections, each with the test client's certificate."""
    listed = tls_mesh.node.ctl(
        "list_connections", "name", "ssl", "peer_cert_subject", "--formatter", "json"
    ).stdout
    connections = json.loads(listed)
    # scheduler, 2 agents and 2 gateways at least (each service holds one connection)
    assert len(connections) >= 5, connections
    assert all(c["ssl"] is True for c in connections), connections
    assert all("shardserve-client" in str(c["peer_cert_subject"]) for c in connections)


async def test_gateway_serves_https_verified_against_the_test_ca(tls_mesh: TlsMesh) -> None:
    trusted = _client_ssl(tls_mesh.broker.certs / "ca.pem")
    assert set(await _infer(tls_mesh.https_url, trusted)) == {-48.0}
    # A client that trusts another CA must refuse the gateway's certificate.
    untrusted = _client_ssl(tls_mesh.broker.foreign / "ca.pem")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await _infer(tls_mesh.https_url, untrusted)
    # And plain HTTP to the TLS port gets no answer.
    with pytest.raises(aiohttp.ClientError):
        await _infer(tls_mesh.https_url.replace("https://", "http://"))
