"""A mesh comes back by itself after its RabbitMQ restarts (stop_app, start_app).

The broker is a private RabbitMQ node (``shardserve.ops.rabbitnode``: own node name, ports,
mnesia and log folders), never the shared one other tests use. A 2-rank matmul mesh runs
on it under light load; the node's app is stopped for a few seconds and started again.
During the outage every request must get a clear 503 at once (none hangs until its
timeout, none is lost); after the node is back the scheduler takes the leadership token
again, the agents' and gateway's consumers come back, readiness turns 200 and inference
answers correctly again, without any process restart.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conditions import wait_until

from shardserve.ops.rabbitnode import NodeError, RabbitNode, port_pair_free, rabbit_available

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from loadcheck import all_close, infer_body, one_request  # noqa: E402

pytestmark = pytest.mark.integration

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
REQUEST_TIMEOUT_S = 8.0
OUTAGE_S = 4.0
RECOVER_WITHIN_S = 30.0


def _node_port() -> int:
    start = random.randrange(5900, 6400)
    for port in range(start, start + 200):
        if port_pair_free(port):
            return port
    pytest.skip("no free port pair for a private RabbitMQ node")


def _http_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def private_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    reason = rabbit_available()
    if reason is not None:
        pytest.skip(f"cannot start a private RabbitMQ node: {reason}")
    node = RabbitNode(tmp_path_factory.mktemp("rabbit"), f"ssbr-{os.getpid()}", _node_port())
    try:
        node.start()
    except NodeError as exc:
        node.kill()
        pytest.skip(f"cannot start a private RabbitMQ node here: {exc}")
    try:
        yield node
    finally:
        node.stop()


@dataclass
class Outcome:
    sent_at: float
    done_at: float
    kind: str
    detail: str


@dataclass
class Load:
    """Two clients in a closed loop; every request's outcome with its times."""

    url: str
    body: bytes = field(default_factory=lambda: infer_body([128, 96]))
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def runs_on(self) -> None:
        """Until 4 more requests have an outcome: the load keeps going."""
        start = len(self.outcomes)
        wait_until("4 more requests of the load", lambda: len(self.outcomes) >= start + 4 or None)

    def _client(self) -> None:
        check = all_close(-48.0)
        while not self.stop.is_set():
            sent = time.monotonic()
            kind, detail = one_request(self.url, self.body, check, REQUEST_TIMEOUT_S)
            self.outcomes.append(Outcome(sent, time.monotonic(), kind, detail))
            time.sleep(0.05)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        return threads


def _start_mesh(repo: Path, amqp_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SHARDSERVE_AMQP_URL": amqp_url, "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [SHARDSERVE, "up", str(repo), "--http-port", str(port), "--grace-seconds", "5"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _ready(base: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/v2/health/ready", timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _wait_serving(base: str, within_s: float) -> bool:
    """Readiness 200 and a correct answer, within ``within_s``."""
    url, body, check = base + "/v2/models/matmul/infer", infer_body([128, 96]), all_close(-48.0)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if _ready(base) == 200 and one_request(url, body, check, 5.0)[0] == "ok":
            return True
        time.sleep(0.2)
    return False


def _stop_mesh(mesh: subprocess.Popen[bytes]) -> None:
    if mesh.poll() is None:
        mesh.send_signal(signal.SIGTERM)
        try:
            mesh.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(mesh.pid, signal.SIGKILL)
            mesh.wait(10)


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def test_mesh_serves_again_after_its_broker_restarts(
    private_node: RabbitNode, export_repo: Any, tmp_path: Path
) -> None:
    repo = export_repo("matmul", tmp_path / "repo", "--rank-size", "2")
    port, log = _http_port(), tmp_path / "mesh.log"
    base = f"http://127.0.0.1:{port}"
    mesh = _start_mesh(repo, private_node.url(), port, log)
    try:
        assert _wait_serving(base, 120.0), _tail(log)
        load = Load(base + "/v2/models/matmul/infer")
        threads = load.run()
        try:
            load.runs_on()
            private_node.ctl("stop_app")
            down_from = time.monotonic()
            time.sleep(OUTAGE_S)
            outage_ready = _ready(base)
            down_until = time.monotonic()
            private_node.ctl("start_app")
            back_at = time.monotonic()
            serving = _wait_serving(base, RECOVER_WITHIN_S)
            recovered_after = time.monotonic() - back_at
            load.runs_on()
        finally:
            load.stop.set()
            for thread in threads:
                thread.join(REQUEST_TIMEOUT_S + 15)
        assert serving, f"not serving {RECOVER_WITHIN_S}s after the restart:\n{_tail(log)}"
        assert outage_ready == 503, outage_ready
        _check_outcomes(load.outcomes, down_from, down_until, log)
        assert any(o.kind == "ok" and o.sent_at > back_at for o in load.outcomes), _tail(log)
        print(f"served again {recovered_after:.1f}s after start_app")
    finally:
        _stop_mesh(mesh)


def _check_outcomes(
    outcomes: list[Outcome], down_from: float, down_until: float, log: Path
) -> None:
    kinds = {k: sum(1 for o in outcomes if o.kind == k) for k in ("ok", "clear_error")}
    bad = [o for o in outcomes if o.kind not in ("ok", "clear_error")]
    assert not bad, (bad[:5], kinds, _tail(log))
    during = [o for o in outcomes if down_from <= o.sent_at and o.done_at <= down_until]
    assert during, "no request was sent while the broker was down"
    for o in during:
        assert o.detail.startswith("503"), (o, _tail(log))
        # "at once": far sooner than the request's own timeout would have ended it
        assert o.done_at - o.sent_at < REQUEST_TIMEOUT_S / 2, o
