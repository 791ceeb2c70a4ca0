"""How large a generation request's body may be, known before any of it is read.

A text prompt past its servable's ``prompt_bytes_limit`` is refused anyway (a 400 naming
the limit). The body is bounded from the same limit, so that a body far past it is
refused with a 413 from its ``Content-Length``, or as soon as that many bytes of a chunked
body have arrived: never read whole and parsed on the event loop that also forwards every
other stream's tokens. Under a flood of 1-2 MB generation bodies that parsing was the
largest cost to the other streams' inter-token latency (issue 36).

JSON escapes one UTF-8 byte of a string into at most 6 characters (``\\u0000``), so a
prompt within the limit takes at most 6x the limit in a body; everything else a request
carries (sampling fields, stop strings, a chat's message structure) gets ``SLACK_BYTES``.
A generation servable whose tokenizer gives no such limit (``prompt_bytes_limit`` None)
leaves bodies at the gateway's ``--max-body-mb``.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from shardserve.wire.protocol import ServableStatus
from shardserve_gateway.errors import PayloadTooLargeError
from shardserve_gateway.state import MESH_VIEW_KEY, SETTINGS_KEY

__all__ = [
    "ESCAPED_BYTES_PER_BYTE",
    "SLACK_BYTES",
    "body_limit",
    "generation_body_limit",
    "too_large",
]

ESCAPED_BYTES_PER_BYTE = 6
SLACK_BYTES = 256 * 1024


def body_limit(servables: Iterable[ServableStatus], max_body_bytes: int) -> int:
    """The most body bytes a request to any of ``servables`` may need (capped by the
    gateway's body limit); the gateway's limit when one has no prompt limit, or none is
    a generation servable."""
    limits = [s.prompt_bytes_limit for s in servables if s.generation]
    if not limits or None in limits:
        return max_body_bytes
    bound = ESCAPED_BYTES_PER_BYTE * max(limit for limit in limits if limit is not None)
    return min(max_body_bytes, bound + SLACK_BYTES)


def generation_body_limit(app: web.Application, model: str | None = None) -> int:
    """``body_limit`` over the generation servables named ``model`` (every one when None:
    an OpenAI body names its model inside), from the latest mesh status, fresh or not
    (without one, the route answers 503 once it looks the servable up)."""
    status = app[MESH_VIEW_KEY].status
    servables = [] if status is None else status.servables
    chosen = [s for s in servables if model is None or s.name == model]
    return body_limit(chosen, app[SETTINGS_KEY].max_body_bytes)


def too_large(limit: int) -> PayloadTooLargeError:
    """The 413 for a generation body past ``limit``."""
    return PayloadTooLargeError(
        limit,
        f"a generation request's body takes at most {ESCAPED_BYTES_PER_BYTE} x its "
        f"servable's prompt byte limit + {SLACK_BYTES // 1024} KiB: the largest prompt "
        "the model's context may take, fully escaped",
    )
