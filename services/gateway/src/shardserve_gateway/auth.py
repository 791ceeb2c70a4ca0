"""Bearer-token authentication (RFC 6750), checked before any body is read.

Every configured token is compared with ``hmac.compare_digest`` (constant time, and all
of them, so the time taken does not tell which token nearly matched). With
``--open-health`` (the default) the liveness/readiness probes and ``/metrics`` stay open
so orchestrators and scrapers need no secret; so do the static status page shell (``/``,
which carries no data: its script sends the token the user gives it as ``/#token=...``)
and ``/openapi.json``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from shardserve_gateway.errors import UnauthorizedError

OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics", "/", "/openapi.json"})


def token_matches(candidate: bytes, tokens: Sequence[bytes]) -> bool:
    """Whether ``candidate`` equals one of ``tokens``, comparing against all in constant time."""
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(candidate, token)
    return matched


def make_auth_middleware(tokens: Sequence[str], *, open_health: bool) -> Middleware | None:
    """A middleware requiring a bearer token, or None when no tokens are configured."""
    if not tokens:
        return None
    encoded = tuple(t.encode("utf-8") for t in tokens)

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if open_health and request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise UnauthorizedError("missing bearer token (send 'Authorization: Bearer <token>')")
        if not token_matches(credentials.strip().encode("utf-8"), encoded):
            raise UnauthorizedError("invalid bearer token")
        return await handler(request)

    return require_token
