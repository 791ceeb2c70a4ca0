"""Gateway settings: command line options that default from ``SHARDSERVE_GATEWAY_*`` env vars.

Each option is declared once, on the ``GatewaySettings`` field it fills
(``shardserve.process.options``). ``build_parser()`` is the pinned command line (see the
README); ``GatewaySettings.from_args`` turns parsed options into the frozen settings object
that ``__main__`` builds once. Bearer tokens come from ``--tokens-file`` (one token a line,
``#`` comments) or from ``SHARDSERVE_GATEWAY_TOKENS`` (comma-separated); both may be given
and are merged.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardserve.process import options
from shardserve.process.options import option
from shardserve.process.settings import BrokerSettings

ENV_PREFIX = "SHARDSERVE_GATEWAY_"
MAX_TIMEOUT_S = 300.0
MIB = 1024 * 1024


def default_gateway_id() -> str:
    """A gateway id unique on the broker: host, pid and a random suffix."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"gw-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway reads from its command line and environment, once."""

    host: str = option("--host", "127.0.0.1")
    http_port: int = option("--http-port", 8080, parse=int)
    grpc_port: int = option(
        "--grpc-port",
        8001,
        parse=int,
        help="port of the KServe v2 / Triton gRPC API (0: no gRPC)",
    )
    default_timeout_s: float = option(
        "--default-timeout",
        30.0,
        parse=float,
        help="seconds a request may take when it names no timeout of its own",
    )
    max_timeout_s: float = option(
        "--max-timeout",
        MAX_TIMEOUT_S,
        parse=float,
        help="upper bound for any request's timeout (seconds)",
    )
    first_token_timeout_s: float = option(
        "--first-token-timeout",
        120.0,
        parse=float,
        help="seconds a generation may wait for its first token (queueing and prefill) when "
        "the request names no timeout of its own",
    )
    token_timeout_s: float = option(
        "--token-timeout",
        30.0,
        parse=float,
        help="seconds a generation may wait between two tokens; without X-Request-Timeout "
        "these, not --default-timeout, bound a generation (up to --max-timeout in all)",
    )
    max_body_bytes: int = option(
        "--max-body-mb",
        64.0,
        parse=float,
        help="largest request body accepted, after decompression (MiB)",
        to_field=lambda mb: int(mb * MIB),
    )
    max_inflight: int = option(
        "--max-inflight",
        256,
        parse=int,
        help="requests this gateway keeps in flight; beyond it, 503 + Retry-After at once",
        to_field=lambda count: max(1, count),
    )
    drain_seconds: float = option(
        "--drain-seconds", 10.0, parse=float, to_field=lambda s: max(0.0, s)
    )
    tokens_file: str | None = option("--tokens-file")
    open_health: bool = option(
        "--open-health",
        True,
        kind="switch",
        help="serve /v2/health/* and /metrics without a token",
    )
    tls_cert: str | None = option("--tls-cert")
    tls_key: str | None = option("--tls-key")
    status_stale_s: float = option(
        "--status-stale-seconds",
        # 6 broadcasts' worth: a CPU-saturated scheduler (16 ranks on 2 cores in the
        # benchmark) was seen 3 s late, and a false "stale" turns every request into a 503.
        6.0,
        parse=float,
        help="scheduler status older than this counts as 'not ready'",
    )
    reuse_port: bool = option(
        "--reuse-port",
        False,
        kind="switch",
        help="share the HTTP port with other gateway processes on this host (SO_REUSEPORT: "
        "the kernel spreads connections across them)",
    )
    gateway_id: str = option(
        "--gateway-id", env="ID", to_field=lambda given: given or default_gateway_id()
    )
    log_level: str | None = option("--log-level")
    tokens: tuple[str, ...] = ()  # from --tokens-file and SHARDSERVE_GATEWAY_TOKENS
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
            first_token_timeout=args.first_token_timeout,
            token_timeout=args.token_timeout,
            max_body_mb=args.max_body_mb,
            status_stale_seconds=args.status_stale_seconds,
        )
        settings = cls(
            **options.option_values(cls, args),
            tokens=load_tokens(args.tokens_file, env.get(ENV_PREFIX + "TOKENS", "")),
            broker=BrokerSettings.from_env(env),
        )
        # No request may wait longer than --max-timeout, its default deadline included.
        return replace(
            settings, default_timeout_s=min(settings.default_timeout_s, settings.max_timeout_s)
        )


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Return the gateway's argument parser; defaults come from the environment."""
    return options.build_parser(
        GatewaySettings,
        os.environ if environ is None else environ,
        prefix=ENV_PREFIX,
        prog="shardserve_gateway",
        description="Front door of shardserve: KServe v2 REST and gRPC, MindSpore Serving REST.",
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
