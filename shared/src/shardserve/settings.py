"""Settings shared by every service: the broker address and logging.

Each service has its own settings class (prefixed environment variables, read once in its
``__main__``); they compose ``BrokerSettings``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
AMQP_URL_ENV = "SHARDSERVE_AMQP_URL"


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
