"""Gateway settings: command line options that default from ``SHARDSERVE_GATEWAY_*`` env vars.

``build_parser()`` is the pinned command line (see the README); ``GatewaySettings.from_args``
turns parsed options into the frozen settings object that ``__main__`` builds once.
Bearer tokens come from ``--tokens-file`` (one token a line, ``#`` comments) or from
``SHARDSERVE_GATEWAY_TOKENS`` (comma-separated); both may be given and are merged.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.process.settings import BrokerSettings, env_default, env_flag

ENV_PREFIX = "SHARDSERVE_GATEWAY_"
MAX_TIMEOUT_S = 300.0


def _env(environ: Mapping[str, str], name: str, default: str) -> str:
    return env_default(environ, ENV_PREFIX, name, default)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Return the gateway's argument parser; defaults come from the environment."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="shardserve_gateway",
        description="HTTP front door of shardserve: KServe v2 and MindSpore Serving REST.",
    )
    p.add_argument("--host", default=_env(env, "HOST", "127.0.0.1"))
    p.add_argument("--http-port", type=int, default=int(_env(env, "HTTP_PORT", "8080")))
    p.add_argument(
        "--default-timeout",
        type=float,
        default=float(_env(env, "DEFAULT_TIMEOUT", "30")),
        help="seconds a request may take when it names no timeout of its own",
    )
    p.add_argument(
        "--max-timeout",
        type=float,
        default=float(_env(env, "MAX_TIMEOUT", str(MAX_TIMEOUT_S))),
        help="upper bound for any request's timeout (seconds)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=float(_env(env, "MAX_BODY_MB", "64")),
        help="largest request body accepted, after decompression (MiB)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=int(_env(env, "MAX_INFLIGHT", "256")),
        help="requests this gateway keeps in flight; beyond it, 503 + Retry-After at once",
    )
    p.add_argument("--drain-seconds", type=float, default=float(_env(env, "DRAIN_SECONDS", "10")))
    p.add_argument("--tokens-file", default=_env(env, "TOKENS_FILE", "") or None)
    p.add_argument(
        "--open-health",
        action=argparse.BooleanOptionalAction,
        default=env_flag(env, ENV_PREFIX, "OPEN_HEALTH", True),
        help="serve /v2/health/* and /metrics without a token",
    )
    p.add_argument("--tls-cert", default=_env(env, "TLS_CERT", "") or None)
    p.add_argument("--tls-key", default=_env(env, "TLS_KEY", "") or None)
    p.add_argument(
        "--status-stale-seconds",
        type=float,
        # 6 broadcasts' worth: a CPU-saturated scheduler (16 ranks on 2 cores in the
        # benchmark) was seen 3 s late, and a false "stale" turns every request into a 503.
        default=float(_env(env, "STATUS_STALE_SECONDS", "6.0")),
        help="scheduler status older than this counts as 'not ready'",
    )
    p.add_argument(
        "--reuse-port",
        action=argparse.BooleanOptionalAction,
        default=env_flag(env, ENV_PREFIX, "REUSE_PORT", False),
        help="share the HTTP port with other gateway processes on this host (SO_REUSEPORT: "
        "the kernel spreads connections across them)",
    )
    p.add_argument("--gateway-id", default=_env(env, "ID", "") or None)
    p.add_argument("--log-level", default=_env(env, "LOG_LEVEL", "") or None)
    return p


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway reads from its command line and environment, once."""

    host: str = "127.0.0.1"
    http_port: int = 8080
    default_timeout_s: float = 30.0
    max_timeout_s: float = MAX_TIMEOUT_S
    max_body_bytes: int = 64 * 1024 * 1024
    drain_seconds: float = 10.0
    tokens: tuple[str, ...] = ()
    open_health: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    status_stale_s: float = 6.0
    max_inflight: int = 256
    reuse_port: bool = False
    gateway_id: str = field(default_factory=lambda: default_gateway_id())
    log_level: str | None = None
    broker: BrokerSettings = field(default_factory=BrokerSettings)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> GatewaySettings:
        """Build settings from parsed options; raises ValueError on inconsistent options."""
        env = os.environ if environ is None else environ
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        _require_positive(
            default_timeout=args.default_timeout,
            max_timeout=args.max_timeout,
            max_body_mb=args.max_body_mb,
            status_stale_seconds=args.status_stale_seconds,
        )
        return cls(
            host=args.host,
            http_port=args.http_port,
            default_timeout_s=min(args.default_timeout, args.max_timeout),
            max_timeout_s=args.max_timeout,
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            drain_seconds=max(0.0, args.drain_seconds),
            tokens=load_tokens(args.tokens_file, env.get(ENV_PREFIX + "TOKENS", "")),
            open_health=args.open_health,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            status_stale_s=args.status_stale_seconds,
            max_inflight=max(1, args.max_inflight),
            reuse_port=args.reuse_port,
            gateway_id=args.gateway_id or default_gateway_id(),
            log_level=args.log_level,
            broker=BrokerSettings.from_env(dict(env)),
        )


def _require_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def load_tokens(tokens_file: str | None, env_tokens: str) -> tuple[str, ...]:
    """Read bearer tokens from a file (one a line, '#' comments) and a comma-separated list."""
    tokens = [t.strip() for t in env_tokens.split(",") if t.strip()]
    if tokens_file:
        for line in Path(tokens_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    return tuple(dict.fromkeys(tokens))


def default_gateway_id() -> str:
    """A gateway id unique on the broker: host, pid and a random suffix."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"gw-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
