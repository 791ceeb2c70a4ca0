"""The server side of ``--tls-cert``/``--tls-key``: one context for each listening port."""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from shardserve_gateway.settings import GatewaySettings


def server_tls(settings: GatewaySettings, alpn: Sequence[str] = ()) -> ssl.SSLContext | None:
    """The TLS context of a port (None: plain TCP); ``alpn``: the protocols it offers
    (gRPC clients insist on ``h2``)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context
