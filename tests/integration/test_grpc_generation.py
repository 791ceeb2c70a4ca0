"""Generation over gRPC: ModelStreamInfer with Triton's decoupled convention, driven by
tritonclient.grpc unchanged, on exported llama fixtures (TP 2): the streamed deltas join to
/v1/completions' greedy text, the last response says final with its finish reason, a
cancelled call frees the KV cache on every rank, errors come back in the stream."""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as triton

from shardserve.ops.child_mesh import LocalMesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import (
    REFERENCE,
    fixture_mesh,
    idle,
    kv_used,
    servable_status,
    wait_for,
)

pytestmark = pytest.mark.integration

SERVABLE = "llama_tp2"
LONG_TOKENS = 100  # the fixture's context is 128 tokens
Answer = tuple[Any, Any]  # (InferResult | None, InferenceServerException | None)


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with fixture_mesh(isolated_amqp_url, tmp_path_factory, SERVABLE, rank_size=2) as mesh:
        yield mesh


@pytest.fixture
def stream(mesh: LocalMesh) -> Iterator[tuple[triton.InferenceServerClient, queue.Queue[Answer]]]:
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        yield client, answers
        client.stop_stream()


def text_input(prompt: str) -> list[triton.InferInput]:
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return [tensor]


def read_until_final(answers: queue.Queue[Answer]) -> tuple[list[str], dict[str, Any]]:
    """The text deltas of one generation and its final response's parameters."""
    deltas: list[str] = []
    while True:
        result, error = answers.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        if response.outputs:
            deltas.append(result.as_numpy("text_output")[0].decode())
        parameters = {
            k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()
        }
        if parameters.get("triton_final_response"):
            return deltas, parameters


def is_final(response: Any) -> bool:
    return "triton_final_response" in response.parameters and bool(
        response.parameters["triton_final_response"].bool_param
    )


def test_streamed_deltas_join_to_the_greedy_completion(mesh: LocalMesh, stream: Any) -> None:
    client, answers = stream
    prompt = REFERENCE["prompts"][0]["text"]
    completion = openai.OpenAI(base_url=mesh.http_url + "/v1", api_key="unused").completions.create(
        model=SERVABLE, prompt=prompt, max_tokens=12, temperature=0
    )
    # Greedy: temperature 0 (tritonclient's parameters carry no floats: the integer 0).
    greedy = {"max_tokens": 12, "temperature": 0}
    client.async_stream_infer(SERVABLE, text_input(prompt), request_id="g1", parameters=greedy)
    deltas, final = read_until_final(answers)
    assert len(deltas) > 1, "one response per text delta"
    assert "".join(deltas) == completion.choices[0].text
    assert final["finish_reason"] == completion.choices[0].finish_reason


def test_an_empty_final_response_when_asked(stream: Any) -> None:
    client, answers = stream
    client.async_stream_infer(
        SERVABLE,
        text_input("Hello"),
        parameters={"max_tokens": 3},
        enable_empty_final_response=True,
    )
    responses = []
    while not responses or not is_final(responses[-1]):
        result, error = answers.get(timeout=120)
        assert error is None, error
        responses.append(result.get_response())
    *deltas, last = responses
    assert deltas and all(response.outputs for response in deltas), "text before the end"
    assert not last.outputs  # the end is marked by an empty response


def test_bad_requests_answer_in_the_stream_and_it_goes_on(stream: Any) -> None:
    client, answers = stream
    client.async_stream_infer(SERVABLE, text_input("Hi"), parameters={"max_tokenz": 3})
    _, error = answers.get(timeout=120)
    assert error is not None and "max_tokenz" in str(error)
    client.async_stream_infer("nope", text_input("Hi"))
    _, error = answers.get(timeout=120)
    assert error is not None and "nope" in str(error)
    sampling = triton.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b"[" * 50_000], dtype=object))  # (found by fuzzing)
    client.async_stream_infer(SERVABLE, [*text_input("Hi"), sampling])
    _, error = answers.get(timeout=120)
    assert error is not None and "'sampling_parameters' is nested too deeply" in str(error)
    client.async_stream_infer(SERVABLE, text_input("Hi"), parameters={"max_tokens": 2})
    deltas, final = read_until_final(answers)
    assert final["finish_reason"] in ("stop", "length")


def test_cancelling_the_call_frees_the_kv_cache_on_every_rank(mesh: LocalMesh) -> None:
    before = servable_status(mesh, SERVABLE).get("generated_tokens_total", 0)
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(
            SERVABLE,
            text_input("Hello"),
            parameters={"max_tokens": LONG_TOKENS, "ignore_eos": True},
        )
        first, error = answers.get(timeout=120)
        assert error is None, error
        assert wait_for(lambda: any(kv_used(mesh, SERVABLE)), 3.0), "KV use never showed"
        left_at = time.monotonic()
        client.stop_stream(cancel_requests=True)
    assert wait_for(lambda: idle(mesh, SERVABLE), 10.0), f"KV still held: {mesh.ranks(SERVABLE)}"
    idle_after = time.monotonic() - left_at
    generated = servable_status(mesh, SERVABLE).get("generated_tokens_total", 0) - before
    print(f"cancel: idle after {idle_after:.2f} s, {generated} tokens generated in all")
    assert 1 <= generated < LONG_TOKENS, "the sequence ran on after the call was cancelled"
