"""The fuzzer's own parts, pure: the OIP spec repair, the links, the message oracle."""

from __future__ import annotations

import time
from collections import Counter

import msgpack
import numpy as np
import schemathesis
from tests.fuzz.amqp_fuzz import AmqpTally, role_of
from tests.fuzz.amqp_messages import (
    LONE_FRAGMENT_SHARE,
    BadMessage,
    generate,
    is_held,
    is_refused,
    message_kinds,
)
from tests.fuzz.http_fuzz import operations, with_links
from tests.fuzz.oip_spec import OIP_GENERATE_SPEC, load_oip_spec
from tests.fuzz.run import FuzzRun
from tests.fuzz.tally import HttpTally

from shardserve.wire import chunking, codec
from shardserve.wire.protocol import InferRequest
from shardserve.wire.tensors import Tensor
from shardserve_gateway.routes.openapi import document


def valid_request() -> bytes:
    tensor = Tensor.from_numpy(np.zeros((1,), np.float32))
    request = InferRequest(
        id="r", servable="matmul", instances=({"x": tensor},), deadline=time.time() + 30
    )
    return codec.encode(request)


def test_the_oip_spec_gets_real_templates_versionless_twins_and_v2() -> None:
    paths = load_oip_spec()["paths"]
    assert "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer" in paths
    assert "/v2/models/{MODEL_NAME}/infer" in paths
    assert "/v2" in paths and "/v2/" in paths
    assert not [p for p in paths if "$" in p]
    twin = paths["/v2/models/{MODEL_NAME}/ready"]
    assert [p["name"] for p in twin["parameters"]] == ["MODEL_NAME"]


def test_the_generate_extension_gets_versionless_twins_too() -> None:
    paths = load_oip_spec(OIP_GENERATE_SPEC)["paths"]
    assert {"/v2/models/{MODEL_NAME}/generate", "/v2/models/{MODEL_NAME}/generate_stream"} <= set(
        paths
    )


def test_the_normalised_oip_spec_loads_in_schemathesis() -> None:
    schema = schemathesis.openapi.from_dict(load_oip_spec())
    labels = {operation.label for operation in operations(schema)}
    assert "POST /v2/models/{MODEL_NAME}/infer" in labels
    assert "GET /v2" in labels


def test_links_added_to_the_gateway_spec_make_a_state_machine() -> None:
    schema = schemathesis.openapi.from_dict(with_links(document()))
    machine = schema.as_state_machine()  # raises on a link to a missing operation
    transitions = [name for name in dir(machine) if "___200_" in name]
    ours = [name for name in transitions if "_of_the_" in name or "_with_the_" in name]
    assert len(ours) == 6, transitions


def test_the_oracle_refuses_bad_bytes_and_accepts_a_valid_message() -> None:
    assert not is_refused(BadMessage("valid", valid_request()))
    assert is_refused(BadMessage("garbage", b"\xc1\xc1"))
    assert is_refused(BadMessage("kind", msgpack.packb({"v": 1, "kind": "infer.request"})))
    half = {chunking.H_ID: "m", chunking.H_INDEX: 0, chunking.H_COUNT: 2, chunking.H_TOTAL: 9}
    assert not is_refused(BadMessage("held chunk", b"abcd", headers=half))  # waits for part 2
    assert is_refused(BadMessage("bad chunk", b"abcd", headers={**half, chunking.H_INDEX: 5}))


def test_generated_messages_are_all_refused_or_held_and_of_every_sort() -> None:
    messages = generate(250, seed=1)
    assert len(messages) == 250
    lone = [m for m in messages if m.label == "lone-fragment"]
    assert len(lone) == 250 // LONE_FRAGMENT_SHARE and all(is_held(m) for m in lone)
    assert all(is_refused(m) for m in messages if m not in lone)
    assert len({m.headers[chunking.H_ID] for m in lone if m.headers}) == len(lone)
    sorts = {m.label.split(":")[0].split("+")[0] for m in messages}
    assert sorts == {
        "garbage",
        "truncated",
        "msgpack-value",
        "unknown-kind",
        "kind",
        "lone-fragment",
    }
    assert any(m.headers for m in messages) and any(m.content_type is None for m in messages)


def test_every_message_kind_of_the_protocol_is_fuzzed() -> None:
    kinds = message_kinds()
    assert {"infer.request", "stage.work", "coll.part", "agent.heartbeat"} <= set(kinds)


def test_queues_get_their_roles() -> None:
    assert role_of("shardserve.requests.c1") == "request"
    assert role_of("shardserve.agent.matmul.1.r0") == "stage-work"
    assert role_of("shardserve.agentctl.matmul-v1-r0-ab") == "agent-control"
    assert role_of("shardserve.scheduler.leader.q2") is None  # tokens are not decoded
    assert role_of("shardserve.dead-letters.q1") is None


def test_a_tally_fails_on_a_server_error_or_no_answer() -> None:
    tally = HttpTally("t")
    tally.record(400, "GET /x")
    assert tally.passed
    tally.record(503, "GET /y")
    assert not tally.passed and tally.failures == ["503: GET /y"]
    silent = HttpTally("s")
    silent.record(0, "GET /z: ReadTimeout")
    assert not silent.passed


def test_a_run_may_leave_one_half_out_but_must_fuzz_something() -> None:
    http = HttpTally("t")
    http.record(400, "GET /x")
    assert FuzzRun(http=[http], demo_ok=True).passed  # --amqp 0
    assert FuzzRun(amqp=AmqpTally(sent_by_role=Counter(request=1)), demo_ok=True).passed
    assert not FuzzRun(demo_ok=True).passed  # nothing fuzzed
    assert not FuzzRun(http=[http], amqp=AmqpTally(), demo_ok=True).passed  # amqp sent none
    assert not FuzzRun(http=[http], demo_ok=False).passed


def test_generation_bodies_mix_well_formed_requests_and_poison() -> None:
    """The generation fuzz reaches the servable (some bodies are valid requests that run)
    and attacks it (others carry poison of every sort); generate/cancel messages only."""
    import json

    from hypothesis import HealthCheck, given, settings
    from tests.fuzz.generation_fuzz import bodies

    from shardserve_gateway.codecs.openai_requests import CompletionBody, parse

    valid, poisoned = [], []

    @settings(
        max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(text=bodies("completions", "llama_tp2"))
    def collect(text: str) -> None:
        try:
            body = parse(CompletionBody, json.loads(text))
            body.sampling(body.max_tokens, body.logprobs)
            body.prompt_kind()
            valid.append(text)
        except Exception:
            poisoned.append(text)

    collect()
    assert len(valid) >= 5 and len(poisoned) >= 50
    labels = {m.label.split("+")[0] for m in generate(30, seed=3, kinds=("generate.request",))}
    assert {k for k in labels if k.startswith("kind:")} == {"kind:generate.request"}
