"""Settings shared by every service: the broker address and logging.

Each service has its own settings class (prefixed environment variables, read once in its
``__main__``); they compose ``BrokerSettings``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar, overload

from shardserve.process.cores import parse_threads

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
AMQP_URL_ENV = "SHARDSERVE_AMQP_URL"
TRUE_WORDS = ("1", "true", "yes", "on")
DefaultT = TypeVar("DefaultT")


@dataclass(frozen=True)
class BrokerSettings:
    """Where the broker is and how to talk to it.

    ``urls`` may hold several brokers (comma-separated in SHARDSERVE_AMQP_URL); the
    connection fails over between them through the one reconnect path.
    """

    urls: tuple[str, ...] = (DEFAULT_AMQP_URL,)
    heartbeat_s: int = 10
    reconnect_interval_s: float = 1.0
    publish_timeout_s: float = 5.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> BrokerSettings:
        env = os.environ if environ is None else environ
        raw = env.get(AMQP_URL_ENV, DEFAULT_AMQP_URL)
        urls = tuple(u.strip() for u in raw.split(",") if u.strip())
        return cls(
            urls=urls or (DEFAULT_AMQP_URL,),
            heartbeat_s=int(env.get("SHARDSERVE_AMQP_HEARTBEAT", "10")),
            reconnect_interval_s=float(env.get("SHARDSERVE_AMQP_RECONNECT_INTERVAL", "1.0")),
        )

    @property
    def url(self) -> str:
        """The first broker URL."""
        return self.urls[0]


# Helpers for the services' command lines: every option defaults from an environment
# variable (``<PREFIX><NAME>``), and argparse applies ``type`` to string defaults, so an env
# value is checked exactly like the same option on the command line.


@overload
def env_default(environ: Mapping[str, str], prefix: str, name: str) -> str | None: ...


@overload
def env_default(
    environ: Mapping[str, str], prefix: str, name: str, default: DefaultT
) -> str | DefaultT: ...


def env_default(
    environ: Mapping[str, str], prefix: str, name: str, default: object = None
) -> object:
    """``environ[prefix + name]``, or ``default`` when it is not set."""
    return environ.get(prefix + name, default)


def env_flag(environ: Mapping[str, str], prefix: str, name: str, default: bool) -> bool:
    """A yes/no variable: 1/true/yes/on (any case) is yes, any other value no, unset ``default``."""
    raw = environ.get(prefix + name)
    if raw is None:
        return default
    return raw.strip().lower() in TRUE_WORDS


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
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
