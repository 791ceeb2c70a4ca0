"""Bad HTTP against the gateway: each probe must end in a 4xx (or a closed connection
for a slow client) within a bound, never a 5xx, a crash or a hang.

Raw sockets are used where an HTTP client would refuse to misbehave (a lying
Content-Length, a client that sends its headers one byte at a time).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shardserve.process.integers import parse_positive_int

PROBE_TIMEOUT_S = 15.0
SLOW_CLIENT_SECONDS = 4.0  # how long the slow client dribbles (bounded on our side)
GZIP_BOMB_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ProbeResult:
    name: str
    status: int  # HTTP status; 0 = connection closed by the server; -1 = no answer in time
    elapsed_s: float
    ok: bool
    note: str = ""


def _x(**overrides: object) -> dict[str, object]:
    tensor: dict[str, object] = {"name": "x", "shape": [128, 96], "datatype": "FP32"}
    tensor["data"] = [1.0] * (128 * 96)
    tensor.update(overrides)
    return tensor


def json_probes() -> dict[str, bytes]:
    """Name -> a body that is wrong in one way."""
    as_json = {
        "wrong-types-data": {"inputs": [_x(data="abc")]},
        "wrong-types-shape": {"inputs": [_x(shape=["128", "96"])]},
        "wrong-types-datatype": {"inputs": [_x(datatype=5)]},
        "inputs-not-a-list": {"inputs": {"x": 1}},
        "huge-shape": {"inputs": [_x(shape=[1_000_000_000, 1_000_000_000], data=[1.0])]},
        "negative-shape": {"inputs": [_x(shape=[-128, 96])]},
        "bytes-abuse-nested": {"inputs": [_x(datatype="BYTES", data=[[[["a"]]]] * 10)]},
        "bytes-abuse-shape": {
            "inputs": [_x(datatype="BYTES", shape=[1_000_000_000], data=["a"] * 3)]
        },
        "wrong-length": {"inputs": [_x(data=[1.0] * 100)]},
        "nan-timeout": {"inputs": [_x()], "parameters": {"timeout_ms": "soon"}},
    }
    probes = {name: json.dumps(body).encode() for name, body in as_json.items()}
    probes["malformed-json"] = b'{"inputs": [{"name": "x", '
    probes["deep-json"] = b"[" * 100_000 + b"]" * 100_000
    return probes


def gzip_bomb(expanded: int = GZIP_BOMB_BYTES) -> bytes:
    """``expanded`` bytes of zeros, gzip-compressed (about 1/1000 of that on the wire)."""
    out = io.BytesIO()
    chunk = b"\0" * (1024 * 1024)
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as gz:
        for _ in range(expanded // len(chunk)):
            gz.write(chunk)
    return out.getvalue()


async def raw_exchange(
    port: int, head: bytes, body: bytes = b"", *, wait_s: float = PROBE_TIMEOUT_S
) -> int:
    """Send bytes as they are; the status of the answer (0: closed, -1: no answer in time)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(wait_s):
            line = await reader.readline()
    except TimeoutError:
        return -1
    except ConnectionError:
        return 0
    finally:
        writer.close()
    parts = line.decode("latin-1").split()  # HTTP/1.1 heads are ISO-8859-1
    status = parse_positive_int(parts[1]) if len(parts) >= 2 else None
    return status or 0


def request_head(path: str, length: int, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def slow_client(port: int, path: str, seconds: float = SLOW_CLIENT_SECONDS) -> int:
    """Slowloris: headers one byte at a time for ``seconds`` (bounded), never finished.

    Returns 0 if the server closed the connection, a status if it answered, -1 if it was
    still waiting when we gave up (acceptable: other clients must be served meanwhile)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + "a" * 1000
    end = time.monotonic() + seconds
    try:
        for byte in head.encode():
            if time.monotonic() >= end:
                return -1
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.2)
            if reader.at_eof():
                return 0
        return -1
    except ConnectionError:
        return 0
    finally:
        writer.close()


Probe = Callable[[], Awaitable[int]]


def probes(base_url: str, port: int, model: str = "matmul") -> dict[str, tuple[Probe, str]]:
    """Name -> (probe, expected status class ``4xx`` or ``closed-or-4xx``)."""
    path = f"/v2/models/{model}/infer"
    table: dict[str, tuple[Probe, str]] = {}
    for name, body in json_probes().items():
        head = request_head(path, len(body), Content_Type="application/json")
        table[name] = (_bound(raw_exchange, port, head, body), "4xx")
    bomb = gzip_bomb()
    bomb_head = request_head(
        path, len(bomb), Content_Type="application/json", Content_Encoding="gzip"
    )
    table["gzip-bomb"] = (_bound(raw_exchange, port, bomb_head, bomb), "4xx")
    lying = request_head(path, 1 << 40, Content_Type="application/json")
    table["oversized-body"] = (_bound(raw_exchange, port, lying, b"{}"), "4xx")
    odd = request_head(path, 2, Content_Type="application/json", Content_Encoding="br")
    table["unknown-encoding"] = (_bound(raw_exchange, port, odd, b"{}"), "4xx")
    bad_id = request_head(path, 2, Content_Type="application/json", X_Request_Id="x" * 500)
    table["bad-request-id"] = (_bound(raw_exchange, port, bad_id, b"{}"), "4xx")
    bad_timeout = request_head(path, 2, Content_Type="application/json", X_Request_Timeout="-5")
    table["bad-timeout"] = (_bound(raw_exchange, port, bad_timeout, b"{}"), "4xx")
    table["slow-client"] = (lambda: slow_client(port, path), "closed-or-4xx")
    return table


def _bound(fn: Callable[..., Awaitable[int]], *args: object) -> Probe:
    return lambda: fn(*args)


def judge(status: int, expected: str) -> bool:
    if 400 <= status < 500:
        return True
    return expected == "closed-or-4xx" and status in (0, -1)


async def run_probes(base_url: str, port: int) -> list[ProbeResult]:
    results = []
    for name, (probe, expected) in probes(base_url, port).items():
        started = time.monotonic()
        try:
            status = await probe()
            note = ""
        except OSError as exc:
            status, note = 0, f"connection error: {exc}"
        elapsed = time.monotonic() - started
        results.append(ProbeResult(name, status, elapsed, judge(status, expected), note))
    return results
