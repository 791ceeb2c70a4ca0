"""shardserve.wire.bounds through the public messages: what validates also encodes and
decodes (msgpack packs no int >= 2**64 and no unpaired surrogate), and what the decoder's
limits would refuse never validates; deadlines are finite, tiny temperatures greedy."""

from __future__ import annotations

import math
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shardserve.errors import CodecError
from shardserve.wire import codec
from shardserve.wire.bounds import (
    MAX_ARRAY_ITEMS,
    MAX_PROMPT_BYTES,
    MAX_STR_BYTES,
    MAX_TOKEN_ID,
    MIN_TEMPERATURE,
)
from shardserve.wire.protocol import GenerateCancel, GenerateRequest, SamplingParams


def request(**fields: Any) -> GenerateRequest:
    base: dict[str, Any] = {"id": "r", "servable": "llm", "deadline": time.time() + 5}
    if not {"prompt", "prompt_ids", "messages"} & set(fields):
        base["prompt"] = "hi"
    return GenerateRequest.model_validate({**base, **fields})


@given(
    prompt=st.text(max_size=50),
    ids=st.lists(st.integers(min_value=-1, max_value=2**65), min_size=1, max_size=4),
    top_k=st.integers(min_value=-1, max_value=2**65),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_whatever_validates_encodes_and_decodes_to_itself(
    prompt: str, ids: list[int], top_k: int, stop: list[str]
) -> None:
    for fields in (
        {"prompt": prompt, "sampling": {"top_k": top_k, "stop": stop}},
        {"prompt_ids": ids, "sampling": {"stop_token_ids": ids}},
        {"prompt": prompt, "sampling": {"logit_bias": [{"token_id": i, "bias": 1} for i in ids]}},
    ):
        try:
            message = request(**fields)
        except ValidationError:
            continue
        assert codec.decode(codec.encode(message)) == message


@pytest.mark.parametrize("deadline", [math.nan, math.inf, -math.inf])
def test_a_deadline_must_be_finite_in_the_model_and_on_the_queue(deadline: float) -> None:
    with pytest.raises(ValidationError, match="finite"):
        request(deadline=deadline)
    raw = request().model_dump() | {"deadline": deadline}
    with pytest.raises(CodecError, match="finite"):
        codec.decode(msgpack.packb(raw))


def test_limits_name_themselves() -> None:
    with pytest.raises(ValidationError, match=f"limit of {MAX_PROMPT_BYTES}"):
        request(prompt="é" * (MAX_PROMPT_BYTES // 2 + 1))  # 2 bytes each
    with pytest.raises(ValidationError, match=str(MAX_TOKEN_ID)):
        request(prompt_ids=[MAX_TOKEN_ID + 1])
    with pytest.raises(ValidationError, match="surrogate|unicode"):
        GenerateCancel(reply_to="q\ud800", correlation_id="c")
    assert request(prompt_ids=[MAX_TOKEN_ID]).prompt_ids == (MAX_TOKEN_ID,)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prompt": "x" * (MAX_STR_BYTES + 1)}, f"a string of {MAX_STR_BYTES + 1} bytes"),
        ({"prompt_ids": [1] * (MAX_ARRAY_ITEMS + 1)}, f"an array of {MAX_ARRAY_ITEMS + 1} items"),
    ],
)
def test_the_decoder_names_the_limit_a_message_is_past(fields: dict[str, Any], words: str) -> None:
    raw = request().model_dump(exclude={"prompt"}) | fields
    with pytest.raises(CodecError, match=f"{words} exceeds the wire's limit of"):
        codec.decode(msgpack.packb(raw))


def test_a_temperature_below_the_minimum_is_greedy() -> None:
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).temperature == 0.0
    assert SamplingParams(temperature=5e-324).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    with pytest.raises(ValidationError):
        SamplingParams(temperature=math.nan)
