"""A robust AMQP connection that fails over between several brokers (a cluster's nodes).

aio-pika's ``RobustConnection`` owns the one reconnect path: when the connection is lost
it retries, waiting ``reconnect_interval`` after each attempt, and, once connected,
restores channels, exchanges, queues and consumers. It retries a single URL at a fixed
interval, though. ``FailoverConnection`` keeps that path and changes two things:

- *where* it reconnects: each failed connect attempt moves to the next URL of the list
  (round robin), so losing a node means one failed attempt on it, then a reconnect to the
  next node, restoring everything there;
- *when*: the wait after a failed attempt follows ``Backoff`` (capped exponential with
  jitter), so a fleet of services does not hammer a broker that is starting, in step.

Built with ``fail_fast="0"`` the very first connect goes through the same path: a service
started before its broker waits for it (``shardserve.amqp.broker.Broker.connect``) instead
of crashing. Every failed attempt is logged once, naming the URL (password hidden) and the
error; aio-pika's own line for the same attempt is dropped (``_OwnAttemptLines``).

The hook is RobustConnection's private per-attempt method; ``tests/unit`` checks that it
still exists, so an aio-pika upgrade that renames it fails loudly instead of silently
retrying one node forever.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aio_pika.robust_connection import RobustConnection
from yarl import URL

from shardserve.process.redact import HIDDEN, redact_url

_logger = logging.getLogger(__name__)

# RobustConnection's per-attempt method (name-mangled ``__connect_transport``).
ATTEMPT_HOOK = "_RobustConnection__connect_transport"
_ROBUST_ONLY = ("reconnect_interval", "fail_fast")
# Upward only: the configured interval stays the shortest wait (tests that need an outage
# of a known minimum length rely on it).
JITTER = 0.2
_AIO_PIKA_ATTEMPT_LINE = "Connection attempt to"
_AIORMQ_TRANSPORT_LINE = "error when creating transport"


@dataclass
class Backoff:
    """Waits between failed connect attempts: ``first_s``, doubling up to ``cap_s``, each
    stretched by up to ``JITTER`` at random so that services do not retry in step."""

    first_s: float
    cap_s: float
    jitter: float = JITTER
    rng: Callable[[], float] = random.random  # in [0, 1)
    _base_s: float = 0.0

    def __post_init__(self) -> None:
        self.cap_s = max(self.cap_s, self.first_s)
        self.reset()

    def reset(self) -> None:
        """A connect succeeded: the next failure waits ``first_s`` again."""
        self._base_s = self.first_s

    def next_wait(self) -> float:
        """The wait after one more failed attempt."""
        wait = self._base_s * (1 + self.jitter * self.rng())
        self._base_s = min(self.cap_s, self._base_s * 2)
        return wait


class FailoverConnection(RobustConnection):
    """``RobustConnection`` over a list of URLs; ``start`` is the index tried first;
    ``max_interval`` caps the back-off (None: a fixed ``reconnect_interval``, no jitter)."""

    def __init__(
        self,
        urls: list[str],
        start: int = 0,
        *,
        max_interval: float | None = None,
        **kwargs: Any,
    ) -> None:
        if not urls:
            raise ValueError("FailoverConnection needs at least one URL")
        _filter_attempt_lines()
        self._urls = [URL(u) for u in urls]
        self._index = start % len(self._urls)
        self._last_attempt_failed = False
        self.attempts = 0  # connect attempts made, successful or not
        self._wait_s = 0.0
        super().__init__(self._urls[self._index], **kwargs)
        first = self._wait_s  # set by RobustConnection.__init__ through the setter below
        cap, jitter = (first, 0.0) if max_interval is None else (max_interval, JITTER)
        self.backoff = Backoff(first, cap, jitter)

    # aio-pika reads this before each wait of its reconnect loop (and in its log lines).
    @property
    def reconnect_interval(self) -> float:
        return self._wait_s

    @reconnect_interval.setter
    def reconnect_interval(self, value: float) -> None:
        self._wait_s = value

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

    async def _RobustConnection__connect_transport(self) -> None:  # see ATTEMPT_HOOK
        if self._last_attempt_failed:
            self._advance()  # here, not on failure, so the failure's log names the failed URL
        self.attempts += 1
        try:
            await getattr(super(), ATTEMPT_HOOK)()
        except Exception as exc:
            self._last_attempt_failed = True
            self._wait_s = self.backoff.next_wait()
            self._log_failure(exc)
            raise
        self._last_attempt_failed = False
        self.backoff.reset()
        self._wait_s = self.backoff.first_s

    def _log_failure(self, exc: Exception) -> None:
        following = self._urls[(self._index + 1) % len(self._urls)]
        where = "" if following == self.url else f" (to {redact_url(str(following))})"
        _logger.warning(
            "broker %s not reachable (attempt %d): %s; next attempt in %.1f s%s",
            self.current_url,
            self.attempts,
            self._error_text(exc),
            self._wait_s,
            where,
        )

    def _error_text(self, exc: Exception) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        password = self.url.password
        return text.replace(password, HIDDEN) if password else text


class _OwnAttemptLines(logging.Filter):
    """Drops the libraries' lines about a failed attempt, so that one attempt is one line:
    aio-pika's about an attempt of a ``FailoverConnection`` (which logged it itself, with
    the password hidden our way), and aiormq's ERROR for a transport it could not open
    (the error is raised to the caller, which says what it means: for a service waiting
    for its broker, no error at all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(_AIORMQ_TRANSPORT_LINE):
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        ours = bool(args) and isinstance(args[0], FailoverConnection)
        return not (ours and message.startswith(_AIO_PIKA_ATTEMPT_LINE))


_ATTEMPT_LINES = _OwnAttemptLines()


def _filter_attempt_lines() -> None:
    """Install the filter on the libraries' loggers: when a FailoverConnection is made,
    not as a side effect of importing this module (addFilter adds one filter once)."""
    logging.getLogger("aio_pika.robust_connection").addFilter(_ATTEMPT_LINES)
    logging.getLogger("aiormq.connection").addFilter(_ATTEMPT_LINES)
