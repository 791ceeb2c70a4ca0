"""What a handler sees of its call (the subset of grpc.aio's ServicerContext the service
uses, with the same names): metadata in, deadline, streamed responses, abort with a
status, trailing metadata out."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NoReturn

from google.protobuf.message import Message

from shardserve_gateway.grpcapi.transport.wire import Metadata, StatusCode

if TYPE_CHECKING:
    from shardserve_gateway.grpcapi.transport.stream import ServerStream


class AbortError(Exception):
    """Raised by ``abort``: the call ends with the status it set (the handler's scope lets
    it through)."""


class CallContext:
    """One call: ``stream`` carries it, ``deadline`` is on ``time.monotonic``'s clock."""

    def __init__(self, stream: ServerStream, metadata: Metadata, deadline: float | None) -> None:
        self._stream = stream
        self._metadata = metadata
        self._deadline = deadline
        self.code = StatusCode.OK
        self.details = ""
        self.trailing_metadata: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        """The request's metadata (``-bin`` values as bytes)."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds to the deadline (None: the client set none; may be negative)."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        """Metadata sent with the status."""
        self.trailing_metadata = tuple(metadata)

    async def abort(
        self, code: StatusCode, details: str, trailing_metadata: Metadata = ()
    ) -> NoReturn:
        """End the call with ``code``; never returns."""
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing_metadata = tuple(trailing_metadata)
        raise AbortError(details)

    async def write(self, message: Message) -> None:
        """Send one response on a streaming call."""
        await self._stream.send_message(message.SerializeToString())

    def done(self) -> bool:
        """The call has ended (status sent, reset by the client, or its connection lost)."""
        return self._stream.ended
