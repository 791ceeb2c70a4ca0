"""``codec.encode_pieces``: large tensor data is spliced into the encoding uncopied, and
the pieces, joined, are exactly ``codec.encode``'s bytes (so receivers see no difference)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import BaseModel

from shardserve.wire import codec
from shardserve.wire.protocol import (
    BundledReply,
    BundledRequest,
    CollectivePart,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
    InstanceResult,
    StageWork,
)
from shardserve.wire.tensors import Tensor, digest_tensors

BIG = codec.SPLICE_MIN_BYTES  # the first size that is spliced


def tensor(nbytes: int, seed: int = 0) -> Tensor:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return Tensor.from_numpy(data)


def work(*sizes: int) -> StageWork:
    inputs = {f"in{i}": tensor(n, seed=i) for i, n in enumerate(sizes)}
    return StageWork(
        job="j1", servable="s", version=1, stage=0, inputs=inputs,
        digest=digest_tensors(inputs), deadline=1e12, result_to="q", requests=("r",),
    )  # fmt: skip


MESSAGES = {
    "one large tensor": work(BIG),
    "large, small, large": work(BIG + 1, 10, 3 * BIG),
    "just below the size": work(BIG - 1),
    "request of two instances": InferRequest(
        id="r", servable="s", instances=({"x": tensor(BIG)}, {"x": tensor(5, seed=1)}), deadline=1.0
    ),
    "reply with outputs": InferReply(
        id="r", servable="s", instances=(InstanceResult(outputs={"y": tensor(2 * BIG)}),)
    ),
    "collective part": CollectivePart(
        job="j", stage=0, step=0, rank=1, tensor=tensor(BIG), phase="shard"
    ),
}
MESSAGES["request bundle"] = InferRequestBundle(
    requests=(BundledRequest(correlation_id="c", request=MESSAGES["request of two instances"]),)
)
MESSAGES["reply bundle"] = InferReplyBundle(
    replies=(BundledReply(correlation_id="c", reply=MESSAGES["reply with outputs"]),)
)


@pytest.mark.parametrize("message", MESSAGES.values(), ids=MESSAGES.keys())
def test_joined_pieces_are_the_encoding(message: BaseModel) -> None:
    pieces = codec.encode_pieces(message)
    assert b"".join(pieces) == codec.encode(message)
    assert codec.decode(b"".join(pieces)) == message


def test_large_data_travels_as_its_own_piece_uncopied() -> None:
    message = work(BIG + 1, 10, 3 * BIG)
    pieces = codec.encode_pieces(message)
    assert len(pieces) == 5  # packed, data, packed, data, packed
    assert pieces[1] is message.inputs["in0"].data
    assert pieces[3] is message.inputs["in2"].data


def test_a_message_without_large_data_is_one_piece() -> None:
    assert codec.encode_pieces(work(100, BIG - 1)) == [codec.encode(work(100, BIG - 1))]
    assert codec.encode_sized(work(BIG), BIG - 1) == codec.encode(work(BIG))


def test_a_marker_found_in_other_bytes_falls_back_to_plain_packing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clash = bytes(range(12))
    small = Tensor(dtype="|u1", shape=(14,), data=b"ab" + clash)  # holds the marker's token
    message = work(BIG).model_copy(update={"inputs": {"big": tensor(BIG), "small": small}})
    monkeypatch.setattr(codec.secrets, "token_bytes", lambda n: clash[:n])
    assert codec.encode_pieces(message) == [codec.encode(message)]


PAYLOADS = {
    "one large tensor": BIG,
    "large, small, large": 4 * BIG + 11,
    "just below the size": BIG - 1,
    "request of two instances": BIG + 5,
    "reply with outputs": 2 * BIG,
    "collective part": BIG,
    "request bundle": BIG + 5,
    "reply bundle": 2 * BIG,
}


@pytest.mark.parametrize("name", MESSAGES.keys())
def test_a_message_knows_its_tensor_payload_and_is_spliced_by_it(name: str) -> None:
    message = MESSAGES[name]
    assert codec.tensor_payload(message) == PAYLOADS[name]
    body = codec.encode_sized(message)
    assert isinstance(body, list) == (PAYLOADS[name] >= BIG)
    assert (b"".join(body) if isinstance(body, list) else body) == codec.encode(message)
