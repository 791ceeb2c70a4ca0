"""Load against the gateway: K closed-loop clients, or an open-loop burst.

Every request carries a unique ``X-Request-Id`` and a known input of the matmul demo
(``x`` = v everywhere, so ``y`` must be -48·v everywhere); the answer is checked. Each
request sets ``X-Request-Timeout``; the client gives up only at that deadline plus a
grace period, and such a request is *hung* (a defect), not an error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from shardserve.ops.chaos.ledger import Ledger, error_code

MATMUL_ROWS, MATMUL_COLS, MATMUL_OUT = 128, 96, 16
VALUES = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # exact in FP32, and so is -48·v


@dataclass(frozen=True)
class LoadSpec:
    base_url: str
    model: str = "matmul"
    timeout_s: float = 5.0  # the request's own deadline (X-Request-Timeout)
    grace_s: float = 5.0  # beyond the deadline: the request is hung

    @property
    def infer_url(self) -> str:
        return f"{self.base_url}/v2/models/{self.model}/infer"


def matmul_body(value: float) -> bytes:
    data = [value] * (MATMUL_ROWS * MATMUL_COLS)
    tensor = {"name": "x", "shape": [MATMUL_ROWS, MATMUL_COLS], "datatype": "FP32", "data": data}
    return json.dumps({"inputs": [tensor]}).encode()


def answer_is_right(body: object, value: float) -> bool:
    """The demo's output for x = value everywhere: y = -48·value everywhere."""
    if not isinstance(body, dict):
        return False
    for out in body.get("outputs", ()):
        if out.get("name") == "y":
            data = out.get("data") or ()
            expected = -48.0 * value
            return len(data) == MATMUL_ROWS * MATMUL_OUT and all(x == expected for x in data)
    return False


class LoadGenerator:
    """Sends requests and writes every outcome into one ledger."""

    def __init__(self, spec: LoadSpec, ledger: Ledger, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.ledger = ledger
        self.clock = clock
        self._bodies = {v: matmul_body(v) for v in VALUES}
        self._values = itertools.cycle(VALUES)
        self._prefix = uuid.uuid4().hex[:8]
        self._seq = itertools.count(1)
        self.latencies: list[float] = []

    def _new_id(self) -> str:
        return f"chaos-{self._prefix}-{next(self._seq)}"

    async def one(self, session: aiohttp.ClientSession) -> None:
        """One request, from send to its single recorded outcome."""
        value = next(self._values)
        rid = self._new_id()
        headers = {
            "X-Request-Id": rid,
            "X-Request-Timeout": f"{self.spec.timeout_s:g}",
            "Content-Type": "application/json",
        }
        started = self.clock()
        self.ledger.send(rid, started)
        limit = aiohttp.ClientTimeout(total=self.spec.timeout_s + self.spec.grace_s)
        try:
            async with session.post(
                self.spec.infer_url, data=self._bodies[value], headers=headers, timeout=limit
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            self.ledger.record(rid, "hung", "hung", self.clock())
            return
        except aiohttp.ClientConnectorError:
            self.ledger.record(rid, "connection", "connection:refused", self.clock())
            return
        except (aiohttp.ClientError, ConnectionError):
            self.ledger.record(rid, "connection", "connection:lost", self.clock())
            return
        self._classify(rid, status, raw, value, started)

    def _classify(self, rid: str, status: int, raw: bytes, value: float, started: float) -> None:
        now = self.clock()
        try:
            body: object = json.loads(raw)
        except ValueError:
            body = raw[:200].decode(errors="replace")
        if status == 200:
            right = answer_is_right(body, value)
            self.ledger.record(rid, "ok" if right else "wrong", "ok" if right else "wrong", now)
            self.latencies.append(now - started)
            return
        self.ledger.record(rid, "error", f"{status}:{error_code(body)}", now)

    async def closed_loop(self, clients: int, stop: asyncio.Event) -> None:
        """K clients, each sending its next request when the previous one ended."""
        connector = aiohttp.TCPConnector(limit=clients, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with asyncio.TaskGroup() as tasks:
                for _ in range(clients):
                    tasks.create_task(self._client(session, stop))

    async def _client(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.one(session)
            if self.ledger.outcomes and self._last_failed():
                await asyncio.sleep(0.05)  # do not spin on instant refusals

    def _last_failed(self) -> bool:
        last = next(reversed(self.ledger.outcomes.values()))
        return last.kind != "ok"

    async def open_loop(self, rate_per_s: float, total: int) -> list[float]:
        """``total`` requests at a fixed rate whatever the answers; returns each latency."""
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with asyncio.TaskGroup() as tasks:
                for i in range(total):
                    tasks.create_task(self.one(session))
                    if i + 1 < total:
                        await asyncio.sleep(1.0 / rate_per_s)
        return [o.done_at - o.sent_at for o in self.ledger.outcomes.values()]
