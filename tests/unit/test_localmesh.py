"""The local mesh runner's process handling, on small real processes (no broker, no mesh)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from shardserve.ops.child_mesh import (
    LocalMesh,
    LoggedProcess,
    MeshError,
    free_port,
    http_get,
    tail_of,
    with_vhost,
)

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)"
)


def python(code: str, log: Path) -> LoggedProcess:
    return LoggedProcess([sys.executable, "-c", code], {}, log)


def test_with_vhost_replaces_the_path_and_quotes_the_name() -> None:
    url = "amqp://u:p@127.0.0.1:5672/"
    assert with_vhost(url, "a/b") == "amqp://u:p@127.0.0.1:5672/a%2Fb"


def test_nothing_listening_answers_status_zero() -> None:
    assert http_get(f"http://127.0.0.1:{free_port()}/v2/health/ready", timeout=2) == (0, None)


def test_stop_returns_the_exit_code_after_sigterm(tmp_path: Path) -> None:
    process = python("import time; print('up', flush=True); time.sleep(60)", tmp_path / "log")
    process.start()
    _wait_for_line(process, "up")
    assert process.stop(timeout=10) == -signal.SIGTERM
    assert not process.alive()


def test_a_process_ignoring_sigterm_is_killed_and_stop_says_so(tmp_path: Path) -> None:
    process = python(IGNORES_SIGTERM, tmp_path / "log")
    process.start()
    _wait_for_line(process, "up")
    assert process.stop(timeout=0.5) is None
    assert not process.alive()


def test_early_exit_fails_readiness_with_the_log(tmp_path: Path) -> None:
    process = python("print('cannot start'); raise SystemExit(1)", tmp_path / "log")
    process.start()
    with pytest.raises(MeshError, match="cannot start"):
        process.wait_http_ready(f"http://127.0.0.1:{free_port()}/", timeout=30)


def test_a_mesh_that_never_started_has_no_services(tmp_path: Path) -> None:
    mesh = LocalMesh(tmp_path, "amqp://127.0.0.1/", free_port(), tmp_path / "log", ("--x",))
    assert mesh.process.argv[-1] == "--x"
    assert mesh.env["SHARDSERVE_AMQP_URL"] == "amqp://127.0.0.1/"
    assert mesh.service_pids("agent") == []
    assert mesh.stop() is None
    assert tail_of(tmp_path / "log", 5) == ""


def _wait_for_line(process: LoggedProcess, line: str) -> None:
    deadline = time.monotonic() + 30
    while line not in process.log_tail(5).splitlines():
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.05)
