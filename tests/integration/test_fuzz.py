"""The fuzz suite's quick form (``scripts/fuzz --quick``) against a real 2-rank mesh.

A few hundred schemathesis requests (the gateway's spec, the OIP spec, the stateful
links), a few hundred Hypothesis-made bad messages into every consumer queue and a few
hundred gRPC calls: no answer >= 500, none missing, every dead letter back, every gRPC
call a status that is not a server's failure, no service lost, the demo still -48.
Beside it the exported llama fixture: 20 poisoned bodies per generation route and 20
malformed generate/cancel messages while well-formed streams give the reference text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardserve.process.settings import AMQP_URL_ENV

pytestmark = [pytest.mark.integration, pytest.mark.heavy]  # (exports the llama fixture)
GENERATION_SOURCES = {
    "generation-completions",
    "generation-chat",
    "generation-triton",
    "generation-triton-stream",
}

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures(amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("fuzz")
    out = work / "figures.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz", "--quick", "--json", str(out)]
        + ["--workdir", str(work / "mesh")],
        cwd=REPO,
        env={**os.environ, AMQP_URL_ENV: amqp_url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), f"no figures written:\n{done.stdout}\n{done.stderr[-4000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    data["_output"] = done.stdout + done.stderr[-4000:]
    data["_code"] = done.returncode
    return data


def test_no_http_answer_is_a_server_error_or_missing(figures: dict[str, Any]) -> None:
    sources = {t["source"]: t for t in figures["http"]}
    matmul = {"gateway-openapi", "oip-spec", "oip-generate-spec", "stateful-links"}
    assert set(sources) == matmul | GENERATION_SOURCES
    for tally in sources.values():
        assert tally["sent"] > 0, figures["_output"]
        assert tally["server_errors"] == 0 and tally["no_answer"] == 0, tally["failures"]
    assert sum(sources[s]["sent"] for s in matmul) >= 200
    assert all(sources[s]["sent"] == 20 for s in GENERATION_SOURCES)


def test_generation_streams_run_right_and_no_rank_is_lost(figures: dict[str, Any]) -> None:
    streams = figures["well_formed_streams"]
    assert streams["right"] > 0 and streams["wrong"] == [], figures["_output"]
    assert figures["ranks_lost"] == 0
    generation = figures["amqp_generation"]
    assert generation["sent"] == 20
    assert generation["dead_letters_seen"] == generation["dead_letters_expected"], generation


def test_every_bad_message_to_a_dead_lettering_consumer_comes_back(
    figures: dict[str, Any],
) -> None:
    amqp = figures["amqp"]
    assert amqp["sent"] >= 300, figures["_output"]
    assert amqp["dead_letters_expected"] > 0
    assert amqp["dead_letters_seen"] == amqp["dead_letters_expected"], amqp
    assert amqp["problems"] == []
    assert {"request", "stage-work", "collective", "scheduler-control"} <= set(amqp["sent_by_role"])


def test_every_grpc_call_ends_with_a_proper_status(figures: dict[str, Any]) -> None:
    calls = figures["grpc"]
    assert calls["sent"] >= 250, figures["_output"]
    assert calls["wrong"] == 0, calls["failures"]
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"} <= set(
        calls["statuses"]
    )
    assert calls["gateway_same_process"] and calls["inflight_settled"]
    assert calls["demo_answers_-48"] is True


def test_services_survive_and_the_demo_still_answers(figures: dict[str, Any]) -> None:
    assert figures["services_lost"] == [], figures["_output"]
    assert figures["services"]["agent"] == 4 and figures["services"]["gateway"] == 1
    assert figures["demo_answers_-48"] is True
    assert figures["passed"] is True and figures["_code"] == 0
