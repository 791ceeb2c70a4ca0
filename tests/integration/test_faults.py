"""The chaos suite's own parts, checked so the suite cannot pass by accident: the ledger
catches lost, duplicated and unexpected outcomes; every injected AMQP body is really
malformed; bad-HTTP probes are judged strictly; the gateway inflates a gzip bomb only up
to its limit. Pure and fast (no broker needed)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from shardserve.errors import CodecError
from shardserve.ops.chaos import names
from shardserve.ops.chaos.amqp_faults import malformed_bodies, request_without_reply_to
from shardserve.ops.chaos.http_faults import gzip_bomb, judge
from shardserve.ops.chaos.ledger import Ledger, error_code
from shardserve.ops.chaos.load import answer_is_right
from shardserve.ops.chaos.report import ScenarioReport
from shardserve.wire import codec
from shardserve_gateway.codecs.body import inflate
from shardserve_gateway.errors import PayloadTooLargeError


def test_ledger_counts_one_outcome_per_request() -> None:
    ledger = Ledger()
    for rid in ("a", "b", "c"):
        ledger.send(rid, 0.0)
    ledger.record("a", "ok", "ok", 1.0)
    ledger.record("b", "error", "503:rank_lost", 1.0)
    assert ledger.lost == 1 and not ledger.exactly_one_outcome()
    ledger.record("c", "connection", "connection:lost", 2.0)
    assert ledger.exactly_one_outcome()
    ledger.record("a", "ok", "ok", 3.0)
    ledger.record("zzz", "ok", "ok", 3.0)
    assert (ledger.duplicated, ledger.unexpected) == (1, 1)
    assert not ledger.exactly_one_outcome()
    assert ledger.errors_by_kind() == {"503:rank_lost": 1, "connection:lost": 1}


def test_a_scenario_with_a_hung_request_fails() -> None:
    ledger = Ledger()
    ledger.send("a", 0.0)
    ledger.record("a", "hung", "hung", 10.0)
    assert not ScenarioReport.from_ledger("x", ledger).passed
    ledger2 = Ledger()
    ledger2.send("a", 0.0)
    assert not ScenarioReport.from_ledger("x", ledger2).passed  # lost


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"error": "deadline exceeded: no reply within 5 s"}, "deadline_exceeded"),
        ({"error": "matmul v1 is not ready: rank 1 missing"}, "rank_lost"),
        ({"error": "x", "code": "overloaded"}, "overloaded"),
        ({"error_msg": "gateway is draining (shutting down)"}, "shutting_down"),
    ],
)
def test_error_codes_are_named(body: object, code: str) -> None:
    assert error_code(body) == code


@pytest.mark.parametrize("name", sorted(malformed_bodies()))
def test_every_injected_body_is_refused_by_the_codec(name: str) -> None:
    with pytest.raises(CodecError):
        codec.decode(malformed_bodies()[name])


def test_the_reply_less_request_is_valid_so_only_the_scheduler_can_refuse_it() -> None:
    assert codec.decode(request_without_reply_to()).kind == "infer.request"


def test_probe_judgement() -> None:
    assert judge(400, "4xx") and judge(413, "4xx")
    assert not judge(500, "4xx") and not judge(200, "4xx") and not judge(-1, "4xx")
    assert judge(0, "closed-or-4xx") and judge(-1, "closed-or-4xx")
    assert not judge(503, "closed-or-4xx")


def test_the_answer_check_refuses_a_wrong_answer() -> None:
    right = {"outputs": [{"name": "y", "data": [-48.0] * (128 * 16)}]}
    assert answer_is_right(right, 1.0)
    assert not answer_is_right(right, 2.0)
    assert not answer_is_right({"outputs": [{"name": "y", "data": [-48.0]}]}, 1.0)


def test_a_gzip_bomb_is_inflated_only_up_to_the_limit() -> None:
    bomb = gzip_bomb(64 * 1024 * 1024)
    assert len(bomb) < 1024 * 1024
    with pytest.raises(PayloadTooLargeError):
        inflate(bomb, "gzip", 1024 * 1024)
    assert inflate(gzip.compress(b'{"a": 1}'), "gzip", 100) == b'{"a": 1}'
    assert inflate(zlib.compress(b"[]"), "deflate", 100) == b"[]"


def test_ci_runs_no_broker_restart() -> None:
    assert "broker-restart" not in names.QUICK
    assert set(names.QUICK) <= set(names.ALL)
