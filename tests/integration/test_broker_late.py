"""Services started before their broker wait for it (issue 31, defect 2): no crash loop.

Real processes (scheduler, gateway, two agents of the matmul demo, each started on its
own as compose or Kubernetes would) are pointed at a private RabbitMQ node
(``shardserve.ops.rabbitnode``) that is started only later. Meanwhile each keeps
running and logs its attempts; the gateway is live, not ready ("broker not connected
yet") and answers 503 (never 500) on every route that needs the mesh. Once the node is
up the mesh becomes ready and answers -48. A SIGTERM during the wait stops a service
cleanly (exit 0, no traceback).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardserve.ops.rabbitnode import NodeError, RabbitNode, port_pair_free, rabbit_available

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from loadcheck import all_close, infer_body  # noqa: E402

pytestmark = pytest.mark.integration

WAIT_FIRST_S = 3.0  # how long the services wait for the absent broker before it starts
# A shorter cap than the default 5 s keeps the test quick; the path is the same.
MAX_INTERVAL_S = 2.0
READY_WITHIN_S = 90.0


def _node_port() -> int:
    start = random.randrange(6400, 6900)
    for port in range(start, start + 200):
        if port_pair_free(port):
            return port
    pytest.skip("no free port pair for a private RabbitMQ node")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    terminated: bool = False

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def attempts(self) -> int:
        return self.text().count("not reachable (attempt")

    def terminate(self) -> None:
        """One SIGTERM, as compose or Kubernetes send (a second one, once the service has
        restored the default handler on its way out, would kill it)."""
        if not self.terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 60.0) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.tail()}") from None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


def _start(name: str, argv: list[str], amqp_url: str, folder: Path) -> Service:
    env = {
        **os.environ,
        "SHARDSERVE_AMQP_URL": amqp_url,
        "SHARDSERVE_AMQP_RECONNECT_MAX_INTERVAL": str(MAX_INTERVAL_S),
        "PYTHONUNBUFFERED": "1",
    }
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return Service(name, proc, log)


def _start_services(repo: Path, amqp_url: str, http_port: int, folder: Path) -> list[Service]:
    agent = ["shardserve_agent", "--repository", str(repo), "--servable", "matmul"]
    return [
        _start("scheduler", ["shardserve_scheduler", "--repository", str(repo)], amqp_url, folder),
        _start(
            "gateway",
            ["shardserve_gateway", "--http-port", str(http_port), "--gateway-id", _gateway_id()],
            amqp_url,
            folder,
        ),
        *(
            _start(
                f"agent{rank}", [*agent, "--rank", str(rank), "--threads", "1"], amqp_url, folder
            )
            for rank in range(2)
        ),
    ]


def _gateway_id() -> str:
    return f"gwlate-{uuid.uuid4().hex[:8]}"


def _request(url: str, body: bytes | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def _wait_for(what: str, check: Any, within_s: float, services: list[Service]) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {s.name}\n{s.tail()}" for s in services)
    raise AssertionError(f"{what}: not within {within_s:g} s\n{logs}")


def _stop_all(services: list[Service]) -> dict[str, int]:
    """Every service's exit code; each is stopped even when one ignores SIGTERM (else the
    rest outlive the test and fail the next one)."""
    for service in reversed(services):  # SIGTERM all first, then wait: quicker
        service.terminate()
    codes: dict[str, int] = {}
    failures: list[str] = []
    for service in services:
        try:
            codes[service.name] = service.stop()
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)
    return codes


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def late_node(tmp_path: Path) -> Iterator[RabbitNode]:
    """A private node, not started: the test starts it when it wants the broker to appear."""
    reason = rabbit_available()
    if reason is not None:
        pytest.skip(f"cannot start a private RabbitMQ node: {reason}")
    node = RabbitNode(tmp_path / "rabbit", f"sslate-{os.getpid()}", _node_port())
    try:
        yield node
    finally:
        node.stop()
        node.kill()


@pytest.fixture
def matmul_repo(export_repo: Any, tmp_path: Path) -> Path:
    return Path(export_repo("matmul", tmp_path / "repo", "--rank-size", "2"))


# ---------------------------------------------------------------- the gateway while waiting


def _mesh_routes(base: str) -> list[tuple[str, str, bytes | None]]:
    """(method, url, body) of requests that need the mesh, valid as far as the gateway
    can tell without one: each must get 503 while the broker is away."""
    infer = infer_body([128, 96])
    text = json.dumps({"model": "matmul", "prompt": "hi", "max_tokens": 2}).encode()
    chat = json.dumps({"model": "matmul", "messages": [{"role": "user", "content": "hi"}]})
    return [
        ("GET", base + "/v2/health/ready", None),
        ("GET", base + "/v2/models/matmul", None),
        ("GET", base + "/v2/models/matmul/ready", None),
        ("POST", base + "/v2/models/matmul/infer", infer),
        ("POST", base + "/v2/models/matmul/versions/1/infer", infer),
        ("POST", base + "/v1/completions", text),
        ("POST", base + "/v1/chat/completions", chat.encode()),
        ("POST", base + "/v2/models/matmul/generate", b'{"text_input": "hi"}'),
        ("POST", base + "/v2/models/matmul/generate_stream", b'{"text_input": "hi"}'),
        ("POST", base + "/v2/repository/models/matmul/load", b"{}"),
    ]


def _check_gateway_waiting(base: str) -> None:
    assert _request(base + "/v2/health/live")[0] == 200
    ready = _request(base + "/v2/health/ready")
    assert ready[0] == 503 and "broker not connected yet" in ready[1], ready
    for method, url, body in _mesh_routes(base):
        status, text = _request(url, body)
        assert status == 503, (method, url, status, text)
    for route in _openapi_paths(base):  # every documented route: never a server error
        for body in (None, b"{}"):
            status, text = _request(base + route, body)
            assert status < 500 or status == 503, (route, body, status, text)


def _openapi_paths(base: str) -> list[str]:
    status, text = _request(base + "/openapi.json")
    assert status == 200, text
    names = {"model": "matmul", "model_name": "matmul", "version": "1", "model_version": "1"}
    paths = []
    for path in json.loads(text)["paths"]:
        for key, value in names.items():
            path = path.replace("{" + key + "}", value)
        paths.append(path.replace("{tail}", "matmul").replace("{", "").replace("}", ""))
    return paths


# ---------------------------------------------------------------- tests


def test_services_started_before_their_broker_wait_then_serve(
    late_node: RabbitNode, matmul_repo: Path, tmp_path: Path
) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    services = _start_services(matmul_repo, late_node.url(), port, tmp_path)
    try:
        _wait_for(
            "every service trying the broker",
            lambda: all(s.attempts() >= 2 for s in services),
            60,
            services,
        )
        time.sleep(WAIT_FIRST_S)
        assert all(s.proc.poll() is None for s in services), [s.tail() for s in services]
        _check_gateway_waiting(base)
        for service in services:
            text = service.text()
            assert f"guest:***@127.0.0.1:{late_node.port}" in text, service.tail()
            assert "guest:guest@" not in text and "Traceback" not in text, service.tail()

        starting = time.monotonic()
        try:
            late_node.start()
        except NodeError as exc:
            pytest.skip(f"cannot start a private RabbitMQ node here: {exc}")
        broker_up = time.monotonic()
        _wait_for("the mesh ready", lambda: _request(base + "/v2/health/ready")[0] == 200,
                  READY_WITHIN_S, services)  # fmt: skip
        ready_after = time.monotonic() - broker_up
        status, text = _request(base + "/v2/models/matmul/infer", infer_body([128, 96]))
        assert status == 200 and all_close(-48.0)(json.loads(text)), (status, text[:300])
        for service in services:
            assert "answered after" in service.text(), service.tail()
        print(
            f"mesh ready {ready_after:.1f} s after the node reported started "
            f"({time.monotonic() - starting:.1f} s after its start began)"
        )
    finally:
        codes = _stop_all(services)
    assert codes == {s.name: 0 for s in services}, [s.tail() for s in services]


def test_sigterm_while_waiting_for_the_broker_exits_cleanly(
    matmul_repo: Path, tmp_path: Path
) -> None:
    nowhere = f"amqp://guest:guest@127.0.0.1:{_free_port()}/"  # nothing listens there
    services = _start_services(matmul_repo, nowhere, _free_port(), tmp_path)
    try:
        _wait_for("every service trying the broker",
                  lambda: all(s.attempts() >= 1 for s in services), 60, services)  # fmt: skip
    finally:
        started = time.monotonic()
        codes = _stop_all(services)
        stopped_in = time.monotonic() - started
    for service in services:
        text = service.text()
        assert codes[service.name] == 0, service.tail()
        assert "Traceback" not in text, service.tail()
    assert "stopped while waiting for the broker" in services[0].text()
    assert stopped_in < 15, stopped_in
