"""Two schedulers, one active: SIGKILL the active one under light load.

Every request gets exactly one outcome (an answer or a clear error; none lost, none
hung), the standby takes over (a new scheduler id in the status), and the mesh serves
again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conditions import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from loadcheck import all_close, infer_body, one_request, run_load

pytestmark = pytest.mark.integration


def _scheduler_pid(scheduler_id: str) -> int:
    # scheduler ids are "<hostname>-<pid>-<random>"; the hostname may contain dashes.
    return int(scheduler_id.rsplit("-", 2)[1])


def _served(mesh: Any) -> int:
    """Requests the active scheduler has counted (its own counters: a successor starts anew)."""
    code, status = mesh.get("/api/status")
    if code != 200:
        return 0
    return sum(s.get("requests_total", 0) for s in status.get("servables", ()))


def _load_reaches(mesh: Any, scheduler: str) -> None:
    """Until the load has had 5 more requests counted by the active ``scheduler``."""
    start = _served(mesh)
    wait_until(f"5 requests of the load on {scheduler}", lambda: _served(mesh) >= start + 5 or None)


def _wait_for_new_scheduler(mesh: Any, old: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, status = mesh.get("/api/status")
        if code == 200 and status.get("scheduler") not in (None, old) and status.get("fresh"):
            if all(s.get("ready") for s in status.get("servables", ())):
                return str(status["scheduler"])
        time.sleep(0.2)
    raise AssertionError(f"no standby took over within {timeout}s:\n{mesh.log_tail()}")


def test_standby_takes_over_when_the_active_scheduler_dies(
    mesh_factory: Any, export_repo: Any, tmp_path: Path
) -> None:
    repo = export_repo("matmul", tmp_path / "repo", "--rank-size", "2", "--stage-size", "1")
    mesh = mesh_factory(repo, "--schedulers", "2")
    url = mesh.http_url + "/v2/models/matmul/infer"
    body, check = infer_body([128, 96]), all_close(-48.0)
    assert one_request(url, body, check, 10.0) == ("ok", "")
    active = mesh.status()["scheduler"]

    stop = threading.Event()
    result: dict[str, Any] = {}
    load = threading.Thread(
        target=lambda: result.update(report=run_load(url, body, check, stop=stop, timeout_s=8.0))
    )
    load.start()
    try:
        _load_reaches(mesh, active)
        os.kill(_scheduler_pid(active), signal.SIGKILL)
        successor = _wait_for_new_scheduler(mesh, active)
        _load_reaches(mesh, successor)  # the load goes on, served by the new active scheduler
    finally:
        stop.set()
        load.join(60)
    summary = result["report"].summary()
    assert summary["lost"] == 0 and summary["hung"] == 0 and summary["wrong"] == 0, summary
    assert summary["ok"] > 0, summary
    assert successor != active
    # Served again by the successor, and the killed one was restarted as a standby.
    assert one_request(url, body, check, 10.0) == ("ok", ""), mesh.log_tail()
    assert mesh.status()["scheduler"] == successor
