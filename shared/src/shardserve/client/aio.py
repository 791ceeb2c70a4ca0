"""``AsyncClient``: the asyncio client of a shardserve gateway (KServe v2 binary tensors).

One aiohttp ``ClientSession`` (one connection pool, kept-alive connections) per client,
created on first use inside the running loop and closed by ``close()`` / ``async with``.
A list of instances becomes one HTTP request per instance, sent concurrently; the
scheduler may still batch them (it batches what arrives within its batch window).
The method is part of the KServe model name: ``POST /v2/models/<servable>:<method>
[/versions/<n>]/infer`` (the gateway's convention for servables with several methods).
``generate`` runs a text-generation servable (``generation.py``; the method is not used).
"""

from __future__ import annotations

import asyncio
import io
import ssl
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, Unpack, overload
from urllib.parse import quote

import aiohttp
import numpy as np

from shardserve.client import generation
from shardserve.client.errors import TransportError, error_from_http
from shardserve.client.kserve import HEADER_LENGTH, decode_response, encode_request
from shardserve.client.values import as_instance, datatype_of
from shardserve.errors import DeadlineError, InferenceError

Result = dict[str, np.ndarray]

# Past this, aiohttp sends a bytes body in one write that may hold the event loop (it
# warns); a file-like body goes out in chunks.
LARGE_BODY_BYTES = 1 << 20
TlsOption = bool | ssl.SSLContext


class AsyncClient:
    """Call one method of one servable through a gateway, from asyncio code.

    ``address`` is ``host:port`` (MindSpore style) or a URL ``http(s)://host:port[/base]``.
    ``version_number`` 0 means the highest ready version. ``timeout`` bounds each HTTP
    request in total (seconds). ``token`` is sent as ``Authorization: Bearer <token>``.
    ``tls`` is False, True (default certificate checks) or an ``ssl.SSLContext``.
    """

    def __init__(
        self,
        address: str,
        servable_name: str,
        method_name: str = "predict",
        version_number: int = 0,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        tls: TlsOption = False,
        max_connections: int = 64,
    ) -> None:
        if version_number < 0:
            raise ValueError(f"version_number must be >= 0, got {version_number}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.servable_name = servable_name
        self.method_name = method_name
        self.version_number = version_number
        self.timeout = timeout
        self.base_url = _base_url(address, tls)
        self.infer_url = _infer_url(self.base_url, servable_name, method_name, version_number)
        self._token = token
        self._ssl: ssl.SSLContext | bool = tls if isinstance(tls, ssl.SSLContext) else True
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; the client cannot be used afterwards (idempotent)."""
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self._default_headers(),
            )
        return self._session

    def _default_headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    # ------------------------------------------------------------ inference

    @overload
    async def infer(
        self,
        instances: dict[str, Any],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> Result: ...

    @overload
    async def infer(
        self,
        instances: Sequence[dict[str, Any]],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> list[Result]: ...

    async def infer(
        self,
        instances: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        request_id: str | None = None,
        outputs: Iterable[str] | None = None,
    ) -> Result | list[Result]:
        """Run the method on one instance (a dict -> a dict of arrays) or on a list of
        instances (-> a list of dicts, in order). Raises an InferenceError subclass; for a
        list, the error of the first failed instance (after all have finished)."""
        names = None if outputs is None else tuple(outputs)
        if isinstance(instances, dict):
            return await self.infer_instance(instances, request_id=request_id, outputs=names)
        if not isinstance(instances, list | tuple) or not instances:
            raise TypeError("instances must be a dict or a non-empty list of dicts")
        return await self._infer_many(instances, request_id, names)

    async def _infer_many(
        self,
        instances: Sequence[dict[str, Any]],
        request_id: str | None,
        outputs: tuple[str, ...] | None,
    ) -> list[Result]:
        checked = [as_instance(instance) for instance in instances]  # fail before sending
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._send(inputs, _nth_id(request_id, i), outputs, i))
                for i, inputs in enumerate(checked)
            ]
        results: list[Result | InferenceError] = [task.result() for task in tasks]
        for result in results:
            if isinstance(result, InferenceError):
                raise result
        return [r for r in results if not isinstance(r, InferenceError)]

    async def _send(
        self,
        inputs: dict[str, np.ndarray],
        request_id: str | None,
        outputs: tuple[str, ...] | None,
        index: int,
    ) -> Result | InferenceError:
        # Errors are returned, not raised, so one failure does not cancel its siblings.
        try:
            return await self._post(inputs, request_id, outputs)
        except InferenceError as exc:
            exc.add_note(f"while running instance {index}")
            return exc

    async def infer_instance(
        self,
        instance: dict[str, Any],
        *,
        request_id: str | None = None,
        outputs: Iterable[str] | None = None,
    ) -> Result:
        """Run the method on one instance; one HTTP request."""
        names = None if outputs is None else tuple(outputs)
        return await self._post(as_instance(instance), request_id, names)

    async def _post(
        self,
        inputs: dict[str, np.ndarray],
        request_id: str | None,
        outputs: tuple[str, ...] | None,
    ) -> Result:
        datatypes = {name: datatype_of(name, array) for name, array in inputs.items()}
        body, json_length = encode_request(
            inputs, datatypes, request_id=request_id, outputs=outputs
        )
        headers = {HEADER_LENGTH: str(json_length)}
        if request_id:
            headers["X-Request-Id"] = request_id
        status, response_headers, payload = await self._exchange(body, headers)
        if status != 200:
            raise error_from_http(status, payload)
        return decode_response(payload, response_headers.get(HEADER_LENGTH))

    # ------------------------------------------------------------ generation

    @overload
    async def generate(
        self,
        prompt: str,
        *,
        stream: Literal[False] = ...,
        **options: Unpack[generation.GenerateOptions],
    ) -> str: ...

    @overload
    async def generate(
        self, prompt: str, *, stream: Literal[True], **options: Unpack[generation.GenerateOptions]
    ) -> AsyncIterator[str]: ...

    async def generate(
        self, prompt: str, *, stream: bool = False, **options: Unpack[generation.GenerateOptions]
    ) -> str | AsyncIterator[str]:
        """Generate text from ``prompt``: the whole text, or with ``stream=True`` an async
        iterator of text deltas (joined, the same text). The options are
        ``generation.GenerateOptions``: ``temperature`` 0 is greedy; None leaves a
        parameter to the server. Raises an InferenceError subclass (before or during the
        stream); ``timeout`` bounds the whole generation."""
        body = generation.request_body(prompt, options)
        headers = generation.request_headers(self.timeout, options.get("request_id"))
        url = generation.generate_url(
            self.base_url, self.servable_name, self.version_number, stream=stream
        )
        if stream:
            return await generation.open_stream(self._get_session(), url, body, headers)
        return await generation.generate_text(self._get_session(), url, body, headers)

    async def _exchange(self, body: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
        session = self._get_session()
        try:
            data = io.BytesIO(body) if len(body) > LARGE_BODY_BYTES else body
            async with session.post(self.infer_url, data=data, headers=headers) as response:
                return response.status, response.headers, await response.read()
        except TimeoutError:
            raise DeadlineError(
                f"no answer from {self.infer_url} within {self.timeout:g}s (client timeout)"
            ) from None
        except aiohttp.ClientError as exc:
            raise TransportError(f"cannot talk to {self.base_url}: {exc}") from exc


def _nth_id(request_id: str | None, index: int) -> str | None:
    return None if request_id is None else f"{request_id}-{index}"


def _base_url(address: str, tls: TlsOption) -> str:
    if "://" in address:
        scheme, _, rest = address.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"address scheme must be http or https, got {scheme!r}")
        return f"{scheme}://{rest.rstrip('/')}"
    scheme = "https" if tls else "http"
    return f"{scheme}://{address.rstrip('/')}"


def _infer_url(base_url: str, servable: str, method: str, version: int) -> str:
    # The gateway's KServe model name for one method of a servable is "<servable>:<method>".
    # The method is always named, so the call runs exactly the method asked for.
    model = f"{base_url}/v2/models/{quote(servable, safe='')}:{quote(method, safe='')}"
    if version > 0:
        model += f"/versions/{version}"
    return f"{model}/infer"
