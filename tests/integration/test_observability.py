"""Observability of a real mesh (matmul over 2 ranks): one request id followed through
gateway, scheduler and agent logs; /metrics covering the whole mesh; the status page and
its time series; the OpenAPI document served by the running gateway."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conditions import wait_until

pytestmark = pytest.mark.integration

ONES = {"inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}]}


Mesh = Any  # tests/integration/conftest.py's Mesh (conftest modules are not importable)


@pytest.fixture(scope="module")
def mesh(mesh_factory: Any, export_repo: Any, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    repo = export_repo(
        "matmul",
        tmp_path_factory.mktemp("repo"),
        "--rank-size",
        "2",
        "--stage-size",
        "1",
        "--strategy",
        "column",
    )
    # DEBUG so that every service logs per-request lines (timeline, stage done, access).
    mp = pytest.MonkeyPatch()
    mp.setenv("SHARDSERVE_LOG_LEVEL", "DEBUG")
    try:
        return mesh_factory(repo)
    finally:
        mp.undo()


def infer(mesh: Mesh, request_id: str | None = None) -> tuple[int, dict[str, str], Any]:
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(
        mesh.http_url + "/v2/models/matmul/infer",
        data=json.dumps(ONES).encode(),
        headers=headers,
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, dict(resp.headers), json.loads(resp.read())


def fetch_text(mesh: Mesh, path: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(mesh.http_url + path, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def log_lines_with(mesh: Mesh, needle: str) -> list[str]:
    text = mesh.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if needle in line]


def test_request_id_reaches_every_service_log(mesh: Mesh) -> None:
    status, headers, body = infer(mesh, "trace-me-123")
    assert status == 200
    assert headers["X-Request-Id"] == "trace-me-123"
    assert body["outputs"][0]["data"][0] == -48.0
    services: set[str] = set()
    deadline = time.monotonic() + 10  # log lines pass through the launcher's pipes
    while time.monotonic() < deadline and not {"gateway", "scheduler", "agent"} <= services:
        lines = log_lines_with(mesh, "req=trace-me-123")
        services = {m.group(1) for line in lines if (m := re.search(r" (\w+)\[\d+\] ", line))}
        time.sleep(0.2)
    assert {"gateway", "scheduler", "agent"} <= services, "\n".join(
        log_lines_with(mesh, "trace-me-123") or [mesh.log_tail(40)]
    )


def test_generated_request_id_is_returned(mesh: Mesh) -> None:
    _, headers, _ = infer(mesh)
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])


RANK0 = 'servable="matmul",version="1",rank="0",stage="0"'
RANK_METRICS = tuple(
    f"{name}{{{RANK0}}}"
    for name in (
        "shardserve_rank_compute_seconds_total",
        "shardserve_rank_collective_seconds_total",
        "shardserve_rank_jobs_done_total",
        "shardserve_rank_rss_bytes",
        "shardserve_rank_heartbeat_age_seconds",
    )
)


def requests_counted(text: str) -> int:
    found = re.search(
        r'^shardserve_servable_requests_total\{servable="matmul",version="1"\} (\d+)$', text, re.M
    )
    return int(found.group(1)) if found else 0


def test_metrics_cover_the_whole_mesh(mesh: Mesh) -> None:
    infer(mesh)
    status, content_type, _ = fetch_text(mesh, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")

    def counted() -> str | None:  # the scheduler broadcasts its counters once a second
        text = fetch_text(mesh, "/metrics")[2]
        return text if requests_counted(text) >= 1 else None

    text = wait_until("the request in the broadcast counters", counted)
    for metric in RANK_METRICS:
        assert metric in text, metric
    assert 'shardserve_rank_up{servable="matmul",version="1",rank="1",stage="0"} 1' in text
    assert re.search(r"^shardserve_request_queue_depth \d+$", text, re.M)
    assert 'shardserve_gateway_requests_total{servable="matmul",method="predict",status="200"}' in (
        text
    )


def test_status_page_timeseries_and_openapi(mesh: Mesh, tmp_path: Path) -> None:
    for _ in range(5):
        infer(mesh)
    status, content_type, page = fetch_text(mesh, "/")
    assert status == 200 and content_type.startswith("text/html")
    assert "<svg" in page and "/api/timeseries" in page
    assert not re.search(r"""(src|href)=["']https?://""", page)  # self-contained

    def reported() -> list[Any] | None:  # a second is reported once it is over
        points: list[Any] = json.loads(fetch_text(mesh, "/api/timeseries?last=30")[2])["points"]
        return points if sum(p["requests"] for p in points) >= 5 else None

    points = wait_until("the 5 requests in the time series", reported)
    assert any(p["p99_ms"] is not None and p["p99_ms"] >= p["p50_ms"] for p in points)
    _, _, spec = fetch_text(mesh, "/openapi.json")
    assert "/v2/repository/index" in json.loads(spec)["paths"]
    _screenshot(mesh, tmp_path)


def _screenshot(mesh: Mesh, tmp_path: Path) -> None:
    """Best effort: a picture of the page for humans (not an assertion about looks)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return
    out = tmp_path / "status.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=3000",
            f"--screenshot={out}",
            "--window-size=1200,800",
            mesh.http_url + "/",
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    if out.exists():
        shutil.copy(out, Path("/tmp/shardserve-status.png"))
