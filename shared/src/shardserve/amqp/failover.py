"""A robust AMQP connection that fails over between several brokers (a cluster's nodes).

aio-pika's ``RobustConnection`` owns the one reconnect path: when the connection is lost
it retries every ``reconnect_interval`` and, once connected, restores channels,
exchanges, queues and consumers. It retries a single URL, though. ``FailoverConnection``
keeps that path and changes only *where* it reconnects: each failed connect attempt moves
to the next URL of the list (round robin), so losing a node means one failed attempt on
it, then a reconnect to the next node, restoring everything there.

The hook is RobustConnection's private per-attempt method; ``tests/unit`` checks that it
still exists, so an aio-pika upgrade that renames it fails loudly instead of silently
retrying one node forever.
"""

from __future__ import annotations

import logging
from typing import Any

from aio_pika.robust_connection import RobustConnection
from yarl import URL

from shardserve.process.redact import redact_url

_logger = logging.getLogger(__name__)

# RobustConnection's per-attempt method (name-mangled ``__connect_transport``).
ATTEMPT_HOOK = "_RobustConnection__connect_transport"
_ROBUST_ONLY = ("reconnect_interval", "fail_fast")


class FailoverConnection(RobustConnection):
    """``RobustConnection`` over a list of URLs; ``start`` is the index tried first."""

    def __init__(self, urls: list[str], start: int = 0, **kwargs: Any) -> None:
        if not urls:
            raise ValueError("FailoverConnection needs at least one URL")
        self._urls = [URL(u) for u in urls]
        self._index = start % len(self._urls)
        self._last_attempt_failed = False
        super().__init__(self._urls[self._index], **kwargs)

    @property
    def current_url(self) -> str:
        return redact_url(str(self.url))

    def _advance(self) -> None:
        """Point the next attempt at the next broker, with that URL's own parameters."""
        if len(self._urls) == 1:
            return
        self._index = (self._index + 1) % len(self._urls)
        context = self.kwargs.get("context")
        self.url = self._urls[self._index]
        self.kwargs = self._parse_parameters(dict(self.url.query))
        for name in _ROBUST_ONLY:
            self.kwargs.pop(name, None)  # RobustConnection keeps these as attributes
        self.kwargs["context"] = context
        _logger.warning("broker unreachable; next attempt goes to %s", redact_url(str(self.url)))

    async def _RobustConnection__connect_transport(self) -> None:  # see ATTEMPT_HOOK
        if self._last_attempt_failed:
            self._advance()  # here, not on failure, so aio-pika's log names the failed URL
        try:
            await getattr(super(), ATTEMPT_HOOK)()
        except Exception:
            self._last_attempt_failed = True
            raise
        self._last_attempt_failed = False
