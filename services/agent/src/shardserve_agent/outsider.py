"""An agent that cannot serve its rank: a rank its group does not have, a slice that is
not on this host, or a slice whose checksum differs from the group config.

It loads nothing, but the scheduler should still see it and refuse it at registration, so
that both sides log the refusal (MindSpore only ever logs on the worker side). The agent
says hello with what it has (the checksum of the files on disk, or none), logs the
scheduler's verdict, and exits 3 either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid

from shardserve.amqp.broker import Broker
from shardserve.errors import ShardserveError
from shardserve.process.waits import within
from shardserve.repo.repository import GroupConfig
from shardserve.wire.protocol import AgentHello, RegistrationVerdict
from shardserve.wire.topology import (
    CONTROL_EXCHANGE,
    KEY_AGENT_HELLO,
    Binding,
    agent_control_key,
    agent_control_queue,
)
from shardserve_agent.settings import AgentSettings

_logger = logging.getLogger(__name__)

ASK_SECONDS = 10.0


async def report_outside_rank(
    settings: AgentSettings,
    group: GroupConfig,
    local_reason: str,
    slice_checksum: str = "",
) -> None:
    """Ask the scheduler to judge this rank; log its reason, or ours if it does not answer."""
    instance = f"outsider-r{settings.rank}-{uuid.uuid4().hex[:12]}"
    broker = Broker(settings.broker, f"agent-{instance}")
    try:
        await broker.connect()
        verdict = await _ask(broker, group, settings.rank, instance, slice_checksum)
    except ShardserveError as exc:
        verdict = None
        _logger.warning("could not reach the scheduler to report the refusal: %s", exc)
    finally:
        await broker.close()
    reason = verdict.reason if verdict is not None else local_reason
    _logger.error(
        "the scheduler refused rank %d of %s v%d: %s",
        settings.rank,
        group.servable,
        group.version,
        reason,
    )


async def _ask(
    broker: Broker, group: GroupConfig, rank: int, instance: str, slice_checksum: str
) -> RegistrationVerdict | None:
    verdicts: asyncio.Queue[RegistrationVerdict] = asyncio.Queue()

    async def on_control(message: object, _incoming: object) -> None:
        if isinstance(message, RegistrationVerdict) and message.instance == instance:
            verdicts.put_nowait(message)

    queue = agent_control_queue(instance)
    binding = Binding(queue.name, CONTROL_EXCHANGE, agent_control_key(instance))
    await broker.declare(queue, (binding,))
    await broker.consume(queue.name, on_control, prefetch=10)
    hello = AgentHello(
        instance=instance,
        servable=group.servable,
        version=group.version,
        rank=rank,
        stage=group.ranks[rank].stage if 0 <= rank < group.rank_size else 0,
        slice_checksum=slice_checksum,
        host=socket.gethostname(),
        pid=os.getpid(),
        state="loading",
        control_key=agent_control_key(instance),
    )
    loop = asyncio.get_running_loop()
    give_up = loop.time() + ASK_SECONDS
    while loop.time() < give_up:
        await broker.publish(CONTROL_EXCHANGE, KEY_AGENT_HELLO, hello)
        try:
            return await within(verdicts.get(), 1.0)
        except TimeoutError:
            continue
    return None
