"""A mesh on a three-node RabbitMQ cluster keeps every request's outcome when a node stops.

Runs ``scripts/rabbit-cluster`` in its short form: three local nodes joined into a
cluster, a 2-rank matmul mesh given all three URLs, steady load, the first node stopped.
Every request must end as an answer or a clear error (none lost, none hung, no wrong
answer) and the mesh must serve again on the surviving nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.ops.rabbitnode import port_pair_free

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rabbit-cluster"

EXIT_SKIP = 77


def _three_ports() -> list[int]:
    ports = [p for p in range(5700, 5900) if port_pair_free(p)][:3]
    if len(ports) < 3:
        pytest.skip("no three free ports in 5700-5899 for the cluster nodes")
    return ports


def test_mesh_survives_a_broker_node_stopping() -> None:
    ports = ",".join(str(p) for p in _three_ports())
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ports", ports, "--before", "3", "--after", "6"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    if done.returncode == EXIT_SKIP:
        pytest.skip(f"cannot start a RabbitMQ cluster here: {done.stderr.strip()[-500:]}")
    assert done.stdout, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["lost"] == 0 and report["hung"] == 0 and report["wrong"] == 0, report
    assert report["ok"] > 0 and report["recovered"], report
    assert done.returncode == 0, (report, done.stderr[-2000:])
