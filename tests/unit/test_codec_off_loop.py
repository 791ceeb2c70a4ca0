"""Big messages are decoded in a thread, the rest on the event loop (a thread hand-off
costs more than decoding a few MiB)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shardserve.wire import codec
from shardserve.wire.protocol import StageWork
from shardserve.wire.tensors import Tensor, digest_tensors


def work_of(nbytes: int) -> bytes:
    inputs = {"x": Tensor.from_numpy(np.zeros(nbytes // 4, dtype=np.float32))}
    work = StageWork(
        job="j1", servable="s", version=1, stage=0, inputs=inputs,
        digest=digest_tensors(inputs), deadline=1e12, result_to="q", requests=("r",),
    )  # fmt: skip
    return codec.encode(work)


@pytest.mark.parametrize(
    ("nbytes", "threaded"),
    [(1536 * 1024, False), (codec.DECODE_OFF_LOOP_BYTES + 1024, True)],
    ids=["1.5 MiB: on the loop", "past the bound: in a thread"],
)
async def test_decode_leaves_the_loop_only_for_big_bodies(
    nbytes: int, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    plain = codec.decode

    def recording(body: bytes) -> object:
        threads.append(threading.get_ident())
        return plain(body)

    monkeypatch.setattr(codec, "decode", recording)
    message = await codec.decode_off_loop(work_of(nbytes))
    assert isinstance(message, StageWork)
    assert message.inputs["x"].data == bytes(nbytes // 4 * 4)
    assert (threads[0] != threading.get_ident()) is threaded
