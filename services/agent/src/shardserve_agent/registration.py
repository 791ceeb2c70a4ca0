"""The agent's side of the control plane: hello, verdict, heartbeat, bye.

The scheduler may start after the agent (or restart): the hello is repeated every second
until a verdict comes, and re-sent whenever a SchedulerHello arrives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any, Literal

from shardserve.amqp.broker import Broker
from shardserve.errors import ShardserveError
from shardserve.process.waits import within
from shardserve.wire.protocol import AgentBye, AgentHeartbeat, AgentHello, RegistrationVerdict
from shardserve.wire.topology import (
    CONTROL_EXCHANGE,
    KEY_AGENT_BYE,
    KEY_AGENT_HEARTBEAT,
    KEY_AGENT_HELLO,
    agent_control_key,
)
from shardserve_agent.slice_loader import LoadedSlice
from shardserve_agent.worker import WorkStats

_logger = logging.getLogger(__name__)

AgentStateName = Literal["loading", "ready", "draining"]


def rss_bytes() -> int:
    """Resident set size of this process (peak RSS where /proc is not available)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Registration:
    """Builds and sends this agent's control messages; receives its verdicts."""

    def __init__(
        self, broker: Broker, loaded: LoadedSlice, instance: str, stats: Callable[[], WorkStats]
    ) -> None:
        self._broker = broker
        self._slice = loaded
        self.instance = instance
        self._stats = stats
        self._verdicts: asyncio.Queue[RegistrationVerdict] = asyncio.Queue()

    def _state(self, state: AgentStateName) -> dict[str, Any]:
        group = self._slice.group
        work = self._stats()
        return dict(
            instance=self.instance,
            servable=group.servable,
            version=group.version,
            rank=self._slice.rank,
            stage=self._slice.stage.index,
            slice_checksum=self._slice.checksum,
            host=socket.gethostname(),
            pid=os.getpid(),
            state=state,
            cache=self._slice.cache,
            load_ms=self._slice.load_ms,
            rss_bytes=rss_bytes(),
            inflight=work.inflight,
            jobs_done=work.jobs_done,
            compute_ms_total=work.compute_ms_total,
            collective_ms_total=work.collective_ms_total,
            kv_capacity_bytes=work.kv_capacity_bytes,
            kv_used_bytes=work.kv_used_bytes,
            kv_bytes_per_token=work.kv_bytes_per_token,
            sequences=work.sequences,
            control_key=agent_control_key(self.instance),
        )

    async def send_hello(self) -> None:
        await self._send(KEY_AGENT_HELLO, AgentHello(**self._state("ready")))

    async def send_heartbeat(self, state: AgentStateName) -> None:
        await self._send(KEY_AGENT_HEARTBEAT, AgentHeartbeat(**self._state(state)))

    async def send_bye(self) -> None:
        await self._send(KEY_AGENT_BYE, AgentBye(**self._state("draining")))

    async def _send(self, key: str, message: AgentHello | AgentHeartbeat | AgentBye) -> None:
        try:
            await self._broker.publish(CONTROL_EXCHANGE, key, message)
        except ShardserveError as exc:  # broker outage: the next beat or hello retries
            _logger.warning("could not send %s: %s", message.kind, exc)

    def on_verdict(self, verdict: RegistrationVerdict) -> None:
        if verdict.instance == self.instance:
            self._verdicts.put_nowait(verdict)

    async def next_verdict(
        self, stop: asyncio.Event, resend_every: float = 1.0
    ) -> RegistrationVerdict | None:
        """Send hello until a verdict arrives (None if ``stop`` is set first)."""
        while not stop.is_set():
            await self.send_hello()
            try:
                return await within(self._verdicts.get(), resend_every)
            except TimeoutError:
                _logger.debug("no registration verdict yet; saying hello again")
        return None

    def pending_verdict(self) -> RegistrationVerdict | None:
        """A verdict that arrived unasked (after a SchedulerHello), if any."""
        try:
            return self._verdicts.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def verdicts(self) -> RegistrationVerdict:
        return await self._verdicts.get()
