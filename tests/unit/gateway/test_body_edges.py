"""Bodies that never finish arriving, and clients that leave mid-body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shardserve_gateway.codecs.body import read_body
from shardserve_gateway.errors import BodyTimeoutError, ClientGoneError


class StalledRequest:
    headers: dict[str, str] = {}
    content_length = None

    def __init__(self, failure: Exception | None = None) -> None:
        self._failure = failure
        self.content = self  # a chunked body (no length) is read piece by piece

    async def iter_any(self) -> AsyncIterator[bytes]:
        if self._failure is not None:
            raise self._failure
        yield b"{"
        await asyncio.Event().wait()  # a client that stopped sending


async def test_a_stalled_body_is_answered_408_at_the_body_timeout() -> None:
    with pytest.raises(BodyTimeoutError) as caught:
        await read_body(StalledRequest(), 1024, body_timeout_s=0.05)  # type: ignore[arg-type]
    assert caught.value.status == 408
    assert "0.05 s" in caught.value.message


async def test_a_client_gone_mid_body_is_not_an_internal_error() -> None:
    request: Any = StalledRequest(ConnectionResetError("Connection lost"))
    with pytest.raises(ClientGoneError):
        await read_body(request, 1024)
