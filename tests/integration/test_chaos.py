"""The chaos suite's fast part: ``shardserve chaos --quick`` on a 2-rank matmul mesh.

One mesh, five scenarios under load (agent SIGKILL, agent SIGSTOP/SIGCONT, scheduler
SIGKILL, malformed AMQP, bad HTTP). No broker restart here: other tests share the broker.
Every request must end with exactly one outcome (hung = lost = duplicated = 0) and the
mesh must recover after each fault.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
CI_SCENARIOS = ("agent-kill", "agent-stop", "scheduler-kill", "malformed-amqp", "bad-http")


@pytest.fixture(scope="module")
def figures(amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("chaos")
    out = work / "figures.json"
    done = subprocess.run(
        [
            SHARDSERVE,
            "chaos",
            "--quick",
            "--scenarios",
            ",".join(CI_SCENARIOS),
            "--json",
            str(out),
            "--workdir",
            str(work / "mesh"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), f"no figures written:\n{done.stdout}\n{done.stderr[-4000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    data["_output"] = done.stdout + done.stderr[-4000:]
    return data


def report_of(figures: dict[str, Any], name: str) -> dict[str, Any]:
    found = [r for r in figures["reports"] if r["name"] == name]
    assert found, f"no report for {name}:\n{figures['_output']}"
    return found[0]


@pytest.mark.parametrize("name", CI_SCENARIOS)
def test_every_request_has_exactly_one_outcome(figures: dict[str, Any], name: str) -> None:
    report = report_of(figures, name)
    assert report["sent"] > 0, figures["_output"]
    assert report["hung"] == 0, report
    assert report["lost"] == 0, report
    assert report["duplicated"] == 0, report
    assert report["unexpected"] == 0, report
    assert report["wrong"] == 0, report
    accounted = report["succeeded"] + report["failed_total"] + report["hung"] + report["wrong"]
    assert accounted == report["sent"], report


@pytest.mark.parametrize("name", CI_SCENARIOS)
def test_the_mesh_recovers(figures: dict[str, Any], name: str) -> None:
    report = report_of(figures, name)
    assert report["recovered"], report
    assert report["problems"] == [], report


@pytest.mark.parametrize("name", ["agent-kill", "agent-stop"])
def test_a_lost_rank_is_detected_and_reported_as_an_error(
    figures: dict[str, Any], name: str
) -> None:
    report = report_of(figures, name)
    assert report["detect_s"] is not None, report
    assert any(kind.startswith("503") for kind in report["failed"]), report


def test_malformed_messages_are_dead_lettered(figures: dict[str, Any]) -> None:
    report = report_of(figures, "malformed-amqp")
    assert report["extra"]["dead_lettered"] == report["extra"]["injected"] > 0, report


def test_bad_http_gets_4xx(figures: dict[str, Any]) -> None:
    probes = report_of(figures, "bad-http")["extra"]["probes"]
    assert probes, probes
    for name, (status, _elapsed) in probes.items():
        assert status < 500, (name, status)
