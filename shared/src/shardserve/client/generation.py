"""Text generation through a gateway: Triton's generate extension, whole or streamed.

Why ``/v2/models/<servable>[/versions/<n>]/generate(_stream)`` and not ``/v1/completions``:
it names the version like the client's ``infer`` does (OpenAI names a model only), and
its errors carry our ErrorCode (``{"error", "code"}``), before the stream and inside it,
so they become exactly the InferenceError subclasses ``infer`` raises.

The gateway's deadline is set from the client's ``timeout`` (``X-Request-Timeout``), so
a generation that runs too long ends with a DeadlineError from the gateway (and its
sequence is cancelled on the mesh) rather than with a cut connection. Leaving a stream
early (``break``, ``aclose``) closes the connection, which cancels the generation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypedDict
from urllib.parse import quote

import aiohttp

from shardserve.client.errors import TransportError, error_from_http
from shardserve.errors import DeadlineError, ErrorCode, InferenceError, InternalError, error_for

DATA_PREFIX = b"data: "


def generate_url(base_url: str, servable: str, version: int, *, stream: bool) -> str:
    model = f"{base_url}/v2/models/{quote(servable, safe='')}"
    if version > 0:
        model += f"/versions/{version}"
    return f"{model}/generate_stream" if stream else f"{model}/generate"


class GenerateOptions(TypedDict, total=False):
    """The keyword options of ``generate`` (both clients), declared once here.

    An option left out (or None) is the server's default: ``max_tokens`` up to the model's
    context, the sampling options the model's generation_config.json. ``temperature`` 0 is
    greedy. ``request_id`` travels as ``X-Request-Id``."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    request_id: str | None


def request_body(prompt: str, options: GenerateOptions) -> dict[str, Any]:
    """The generate body; parameters left out or None are the server's defaults."""
    unknown = sorted(set(options) - GenerateOptions.__optional_keys__)
    if unknown:  # **options checks no names at run time: say which one is wrong
        raise TypeError(f"generate() got unknown options {unknown}")
    stop = options.get("stop")
    stops = [stop] if isinstance(stop, str) else (list(stop) if stop is not None else None)
    stop_token_ids = options.get("stop_token_ids")
    parameters = {
        "max_tokens": options.get("max_tokens"),
        "temperature": options.get("temperature"),
        "top_p": options.get("top_p"),
        "top_k": options.get("top_k"),
        "seed": options.get("seed"),
        "stop": stops,
        "stop_token_ids": list(stop_token_ids) if stop_token_ids is not None else None,
        "ignore_eos": options.get("ignore_eos") or None,
    }
    return {
        "text_input": prompt,
        "parameters": {k: v for k, v in parameters.items() if v is not None},
    }


def request_headers(timeout_s: float, request_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Timeout": f"{timeout_s:g}"}
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers


async def generate_text(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> str:
    """POST to ``/generate``: the whole text, or the call's InferenceError."""
    async with _posted(session, url, body, headers) as response:
        payload = await response.read()
    try:
        text = json.loads(payload)["text_output"]
    except (ValueError, KeyError, TypeError):
        raise InternalError(f"{url} answered without text_output: {payload[:200]!r}") from None
    if not isinstance(text, str):
        raise InternalError(f"{url} answered a text_output that is not a string")
    return text


async def open_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[str]:
    """POST to ``/generate_stream``; errors before the stream raise here, and the text
    deltas come from the returned iterator (which raises a later error)."""
    context = _posted(session, url, body, headers)
    response = await context.__aenter__()
    return _deltas(response, context)


async def _deltas(response: aiohttp.ClientResponse, context: _Posted) -> AsyncIterator[str]:
    try:
        async for event in _events(response):
            if "error" in event:
                raise _event_error(event)
            text = event.get("text_output", "")
            if text:
                yield text
    except aiohttp.ClientError as exc:
        raise TransportError(f"the stream from {response.url} broke: {exc}") from exc
    except TimeoutError:
        raise DeadlineError(f"the stream from {response.url} timed out (client timeout)") from None
    finally:
        await context.__aexit__(None, None, None)


def _event_error(event: dict[str, Any]) -> InferenceError:
    """The error a stream's last event reports, typed by its ErrorCode."""
    code = event.get("code")
    if not isinstance(code, str) or code not in ErrorCode._value2member_map_:
        code = ErrorCode.INTERNAL
    return error_for(ErrorCode(code), str(event["error"]))


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of the SSE ``data:`` lines."""
    async for line in response.content:
        if not line.startswith(DATA_PREFIX):
            continue
        try:
            event = json.loads(line[len(DATA_PREFIX) :])
        except ValueError:
            raise InternalError(f"malformed event in the stream: {line[:200]!r}") from None
        if isinstance(event, dict):
            yield event


class _Posted:
    """``async with``: POST, raise the HTTP error (typed), yield the 200 response."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        self._request = session.post(url, json=body, headers=headers)
        self._url = url
        self._timeout_s = session.timeout.total

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            response = await self._request.__aenter__()
            if response.status != 200:
                payload = await response.read()
                await self._request.__aexit__(None, None, None)
                raise error_from_http(response.status, payload)
            return response
        except TimeoutError:
            raise DeadlineError(
                f"no answer from {self._url} within {self._timeout_s}s (client timeout)"
            ) from None
        except aiohttp.ClientError as exc:
            raise TransportError(f"cannot talk to {self._url}: {exc}") from exc

    async def __aexit__(self, *exc_info: object) -> None:
        await self._request.__aexit__(None, None, None)


def _posted(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> _Posted:
    return _Posted(session, url, body, headers)
