"""A request body the decoder refuses is answered from its AMQP properties: a one-chunk
``bad_input`` stream for a generate request, an InferReply for an inference request, the
decoder's reason in it; nothing without a reply_to and a correlation_id, or of another type."""

from __future__ import annotations

import pytest

from shardserve.errors import ErrorCode
from shardserve_scheduler.core.actions import Reply, SendChunk
from shardserve_scheduler.unreadable import answer_unreadable

PROBLEM = "a string of 2000000 bytes exceeds the wire's limit of 1048576"


def test_a_generate_request_gets_a_one_chunk_stream_naming_the_problem() -> None:
    answer = answer_unreadable("replies", "c1", "generate.request", PROBLEM)
    assert isinstance(answer, SendChunk)
    assert (answer.reply_to, answer.correlation_id) == ("replies", "c1")
    chunk = answer.chunk
    assert chunk.seq == 0 and chunk.last and chunk.error is not None
    assert chunk.error.code == ErrorCode.BAD_INPUT and PROBLEM in chunk.error.message


def test_an_infer_request_gets_an_error_reply() -> None:
    answer = answer_unreadable("replies", "c2", "infer.request", PROBLEM)
    assert isinstance(answer, Reply) and answer.correlation_id == "c2"
    assert answer.reply.error is not None and PROBLEM in answer.reply.error.message


@pytest.mark.parametrize(
    ("reply_to", "correlation_id", "message_type"),
    [
        (None, "c", "generate.request"),
        ("replies", None, "generate.request"),
        ("replies", "c", None),
        ("replies", "c", "generate.cancel"),
        ("replies", "c", "infer.request_bundle"),
    ],
)
def test_nobody_to_answer_or_not_a_request_is_only_dead_lettered(
    reply_to: str | None, correlation_id: str | None, message_type: str | None
) -> None:
    assert answer_unreadable(reply_to, correlation_id, message_type, PROBLEM) is None
