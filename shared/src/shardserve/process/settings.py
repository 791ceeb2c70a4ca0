"""Settings shared by every service: the broker address, logging and the event loop.

Each service has its own settings class (options declared once, see
``shardserve.process.options``; prefixed environment variables, read once in its
``__main__``); they compose ``BrokerSettings``, which is read from the environment only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardserve.process.cores import parse_threads
from shardserve.process.integers import ASCII_DIGITS_RULE, parse_positive_int
from shardserve.process.options import from_environment, variable

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
AMQP_URL_ENV = "SHARDSERVE_AMQP_URL"
LOG_LEVEL_ENV = "SHARDSERVE_LOG_LEVEL"
EVENT_LOOP_ENV = "SHARDSERVE_EVENT_LOOP"
MAX_MESSAGE_BYTES_ENV = "SHARDSERVE_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MIN_MESSAGE_BYTES = 1024  # a smaller chunk size would only multiply messages


def broker_urls(text: str) -> tuple[str, ...]:
    """Comma-separated broker URLs (a cluster's nodes); blanks between commas ignored."""
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    return urls or (DEFAULT_AMQP_URL,)


def message_bytes(text: str) -> int:
    """The largest message the broker is sent; bigger bodies go as chunks
    (``shardserve.wire.chunking``)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{MAX_MESSAGE_BYTES_ENV} must be an integer, got {text!r}") from None
    if value < MIN_MESSAGE_BYTES:
        raise ValueError(f"{MAX_MESSAGE_BYTES_ENV} must be at least {MIN_MESSAGE_BYTES}")
    return value


def positive_seconds(text: str) -> float:
    """A duration > 0 from an environment variable."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be a number of seconds > 0, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    """A duration >= 0 from an environment variable (0 usually means "no limit")."""
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number of seconds >= 0, got {text!r}")
    return value


@dataclass(frozen=True)
class BrokerSettings:
    """Where the broker is and how to talk to it.

    ``urls`` may hold several brokers (comma-separated in SHARDSERVE_AMQP_URL); the
    connection fails over between them through the one reconnect path. That path also
    makes the first connection: a service started before its broker waits for it, the
    wait after each failed attempt doubling from ``reconnect_interval_s`` up to
    ``reconnect_max_interval_s`` (plus jitter), for ``connect_wait_s`` at most (0: for as
    long as it takes, what compose and Kubernetes expect of a service).
    """

    urls: tuple[str, ...] = variable(AMQP_URL_ENV, (DEFAULT_AMQP_URL,), parse=broker_urls)
    heartbeat_s: int = variable("SHARDSERVE_AMQP_HEARTBEAT", 10, parse=int)
    reconnect_interval_s: float = variable(
        "SHARDSERVE_AMQP_RECONNECT_INTERVAL", 0.5, parse=positive_seconds
    )
    reconnect_max_interval_s: float = variable(
        "SHARDSERVE_AMQP_RECONNECT_MAX_INTERVAL", 5.0, parse=positive_seconds
    )
    connect_wait_s: float = variable(
        "SHARDSERVE_AMQP_CONNECT_WAIT", 0.0, parse=non_negative_seconds
    )
    publish_timeout_s: float = 5.0
    max_message_bytes: int = variable(
        MAX_MESSAGE_BYTES_ENV, DEFAULT_MAX_MESSAGE_BYTES, parse=message_bytes
    )
    # An incomplete chunked message is given up (dead-lettered) this long after its first
    # chunk: 120 s, as ``chunking.DEFAULT_EXPIRY_S`` (tests/unit/test_chunking.py compares).
    chunk_expiry_s: float = variable("SHARDSERVE_CHUNK_EXPIRY", 120.0, parse=positive_seconds)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BrokerSettings:
        return from_environment(cls, os.environ if environ is None else environ)

    @property
    def url(self) -> str:
        """The first broker URL."""
        return self.urls[0]


@dataclass(frozen=True)
class ProcessSettings:
    """How any shardserve process runs: its log level (a service's own ``--log-level``
    wins) and its event loop (see ``shardserve.process.eventloop``)."""

    log_level: str = variable(LOG_LEVEL_ENV, "INFO", parse=str)
    event_loop: str | None = variable(EVENT_LOOP_ENV, None, parse=str)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProcessSettings:
        return from_environment(cls, os.environ if environ is None else environ)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the one for every command line of the project)."""
    value = parse_positive_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be >= 1 {ASCII_DIGITS_RULE}, got {text!r}")
    return value


def threads_count(text: str) -> int | None:
    """argparse type: onnxruntime threads, a count >= 1 or ``auto`` (None: from the cores,
    see ``shardserve.process.cores``)."""
    try:
        return parse_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
