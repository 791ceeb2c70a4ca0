"""URLs shown without their password: in logs, errors and reports a broker URL appears as
``amqp://user:***@host:5672/vhost``, every other part kept as written."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

HIDDEN = "***"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``; unchanged when it holds none."""
    parts = urlsplit(url)
    # The netloc is split at its last "@", as urlsplit does: a password may hold "@".
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{HIDDEN}@{host}"))
