"""What one tensor-parallel collective costs on the wall: the agents' code vs the broker floor.

    python -m benchmarks.collective_hop [--count 2000] [--sizes 4096,131072]
        [--modes hub,broker,lean,aiormq] [--url AMQP_URL] [--json PATH]

Two processes (rank 0 and rank 1 of one stage, as two agents run) exchange parts, each
on its own connection, and each times every exchange from entering it to holding the
result:

- ``hub``: the agents' real collective path: ``CollectiveHub`` over the agents' wiring
  (``shardserve.amqp.collective_link``: the stage's collective exchange, each rank's
  collective queue), jobs of ``STEPS_PER_JOB`` allreduces of fp32 parts (a decode step
  of bench-large: 2 per layer x 8 + the LM head);
- ``broker``: the same hub over the services' ``Broker`` (aio-pika, msgpack parts), the
  agents' path before the link;
- ``lean``: the same exchange over the link's connection alone
  (``shardserve.amqp.lean``): each rank publishes raw bytes to the peer's queue and
  waits for the peer's (no parts, no hub): the floor of this path;
- ``aiormq``: the same with raw aiormq (the layer under aio-pika), no acks, no decoding.

Both ranks enter each exchange together only if they leave the previous one together, so
the figure is one broker hop plus what each side adds, as in a decode step. Printed per
mode and size: median, p99 and mean ms per exchange (both ranks' timings pooled, warm-up
dropped) and the CPU each rank spent per exchange. ``--rank`` runs one side (the parent
starts two of them).

Measured on the 2-core development machine, quiet (load < 1), 3000 exchanges:

    mode     4 KiB: median  p99   CPU/rank    128 KiB: median  p99   CPU/rank
    hub             0.254  0.690   113 us              0.615  1.670   320 us
    broker          0.668  1.586   410 us              1.023  2.584   707 us
    lean            0.145  0.440    38 us              0.332  0.941   123 us
    aiormq          0.465  0.900   235 us              0.802  1.427   387 us
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiormq
import numpy as np
from aio_pika.abc import AbstractIncomingMessage
from aiormq.abc import DeliveredMessage

from shardserve.amqp import lean
from shardserve.amqp.broker import Broker
from shardserve.amqp.collective import CollectiveHub, sum_in_rank_order
from shardserve.amqp.collective_link import CollectiveLink
from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.settings import AMQP_URL_ENV, DEFAULT_AMQP_URL, BrokerSettings
from shardserve.wire.parts import Part
from shardserve.wire.protocol import CollectivePart, Message
from shardserve.wire.topology import (
    COLLECTIVE_EXCHANGE,
    EXCHANGES,
    Binding,
    agent_collective_queue,
    stage_key,
)

STEPS_PER_JOB = 17
WARMUP = 50  # exchanges dropped from the figures (connections, caches, JIT of the broker)
SERVABLE = "collhop"


def _queue_name(run: str, rank: int) -> str:
    return agent_collective_queue(f"{SERVABLE}-{run}", 1, rank).name


def _key(run: str) -> str:
    return stage_key(f"{SERVABLE}-{run}", 1, 0)


async def hub_rank(url: str, run: str, rank: int, size: int, count: int) -> list[float]:
    """``count`` allreduces through the agents' collective path; ms of each."""
    queue = agent_collective_queue(f"{SERVABLE}-{run}", 1, rank)
    link = CollectiveLink(
        BrokerSettings(urls=(url,)),
        f"collhop-{run}-r{rank}",
        queue=queue,
        bindings=(Binding(queue.name, COLLECTIVE_EXCHANGE, _key(run)),),
        stage_route=(COLLECTIVE_EXCHANGE, _key(run)),
        peer_queue=lambda peer: _queue_name(run, peer),
    )
    hub = CollectiveHub(
        rank=rank, stage=0, stage_ranks=(0, 1), publish=link.publish, send_to=link.send_to
    )
    link.attach(hub.accept)
    await link.open()
    try:
        return await _allreduces(hub, run, rank, size // 4, count)
    finally:
        await link.close()


async def broker_rank(url: str, run: str, rank: int, size: int, count: int) -> list[float]:
    """``hub`` over the services' ``Broker`` (aio-pika, msgpack parts): the agents' path
    before the link, kept to compare."""
    broker = Broker(BrokerSettings(urls=(url,)), f"collhop-broker-{run}-r{rank}")
    await broker.connect()
    key = _key(run)

    async def publish(part: Part) -> None:
        await broker.publish(COLLECTIVE_EXCHANGE, key, part.message())

    async def send_to(peer: int, part: Part) -> None:
        await broker.publish("", _queue_name(run, peer), part.message())

    hub = CollectiveHub(rank=rank, stage=0, stage_ranks=(0, 1), publish=publish, send_to=send_to)

    async def on_part(message: Message, _: AbstractIncomingMessage) -> None:
        assert isinstance(message, CollectivePart)
        hub.accept(message)

    queue = agent_collective_queue(f"{SERVABLE}-{run}", 1, rank)
    try:
        await broker.declare(queue, (Binding(queue.name, COLLECTIVE_EXCHANGE, key),))
        await broker.consume(queue.name, on_part, prefetch=1000, no_ack=True)
        return await _allreduces(hub, run, rank, size // 4, count)
    finally:
        await broker.close()


async def _allreduces(
    hub: CollectiveHub, run: str, rank: int, elements: int, count: int
) -> list[float]:
    part = np.full((1, elements), float(rank + 1), dtype=np.float32)
    expected = float(sum_in_rank_order([np.ones(1, np.float32), np.full(1, 2.0, np.float32)])[0])
    timings: list[float] = []
    for job_index in range((count + STEPS_PER_JOB - 1) // STEPS_PER_JOB):
        job = f"{run}:{job_index}"
        collective = hub.begin(job, deadline=time.time() + 60.0)
        for step in range(STEPS_PER_JOB):
            started = time.perf_counter()
            total = await collective.allreduce(step, part)
            timings.append((time.perf_counter() - started) * 1000)
            if float(total[0, -1]) != expected:
                raise RuntimeError(f"rank {rank}: wrong sum in job {job} step {step}")
        hub.finish(job)
    return timings[:count]


class _Arrivals:
    """Counts the peer's messages; ``exchange`` times send-then-wait-for-the-peer rounds."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def arrived(self, *_: object) -> None:
        self.count += 1
        self.changed.set()

    async def exchange(self, count: int, send: Callable[[], Awaitable[None]]) -> list[float]:
        """``count`` rounds: send, then wait for the peer's n-th message; ms of each."""
        timings: list[float] = []
        for n in range(count):
            started = time.perf_counter()
            await send()
            while self.count <= n:
                self.changed.clear()
                await self.changed.wait()
            timings.append((time.perf_counter() - started) * 1000)
        return timings


async def aiormq_rank(url: str, run: str, rank: int, size: int, count: int) -> list[float]:
    """``count`` exchanges of ``size`` bytes with raw aiormq; ms of each."""
    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        arrivals = _Arrivals()

        async def on_message(message: DeliveredMessage) -> None:
            arrivals.arrived(message)

        mine = _queue_name(run, rank)
        await channel.queue_declare(mine, auto_delete=True)
        await channel.basic_consume(mine, on_message, no_ack=True)
        peer, body = _queue_name(run, 1 - rank), bytes(size)

        async def send() -> None:
            await channel.basic_publish(body, routing_key=peer)

        return await arrivals.exchange(count, send)
    finally:
        await connection.close()


async def lean_rank(url: str, run: str, rank: int, size: int, count: int) -> list[float]:
    """``count`` exchanges of ``size`` bytes over the lean connection alone (no parts, no
    hub): what the link adds to a hop is ``hub`` minus this."""
    arrivals = _Arrivals()
    connection = await lean.open_connection(
        url, f"collhop-lean-{run}-r{rank}", arrivals.arrived, heartbeat_s=10, timeout_s=10
    )
    try:
        await connection.consume(_queue_name(run, rank))
        peer, body = _queue_name(run, 1 - rank), bytes(size)

        async def send() -> None:
            connection.publish("", peer, [body])

        return await arrivals.exchange(count, send)
    finally:
        await connection.close()


RANK_MODES = {"hub": hub_rank, "broker": broker_rank, "lean": lean_rank, "aiormq": aiormq_rank}


async def _declare_queues(url: str, run: str) -> aiormq.abc.AbstractConnection:
    """Both ranks' queues and bindings, before either rank starts, so no part is lost to
    a queue that does not exist yet; the connection holds them until the ranks consume."""
    connection = await aiormq.connect(url)
    channel = await connection.channel()
    collective = next(e for e in EXCHANGES if e.name == COLLECTIVE_EXCHANGE)
    await channel.exchange_declare(
        collective.name, exchange_type=collective.kind, durable=collective.durable
    )
    for rank in (0, 1):
        await channel.queue_declare(_queue_name(run, rank), auto_delete=True)
        await channel.queue_bind(_queue_name(run, rank), COLLECTIVE_EXCHANGE, _key(run))
    return connection


def _run_pair(url: str, mode: str, size: int, count: int) -> tuple[list[list[float]], float]:
    """Start both ranks of one measurement: every rank's timings, and the CPU seconds
    both spent (their whole run: connecting too)."""
    run = uuid.uuid4().hex[:8]

    async def declare() -> None:
        connection = await _declare_queues(url, run)
        await connection.close()  # auto-delete queues stay until a consumer has come and gone

    asyncio.run(declare())
    argv = [sys.executable, "-m", "benchmarks.collective_hop", "--url", url, "--run", run]
    argv += ["--mode", mode, "--bytes", str(size), "--count", str(count)]
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    timings, cpu_s = [], 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} rank failed ({proc.returncode})")
        line = json.loads(out.strip().splitlines()[-1])
        timings.append(line["ms"])
        cpu_s += line["cpu_s"]
    return timings, cpu_s


def figures(timings: list[list[float]], cpu_s: float) -> dict[str, float]:
    pooled = sorted(t for rank in timings for t in rank[WARMUP:])
    exchanges = sum(len(rank) for rank in timings)
    return {
        "cpu_us_per_rank_exchange": round(cpu_s / exchanges * 1e6, 1),
        "median_ms": round(statistics.median(pooled), 3),
        "p99_ms": round(pooled[int(0.99 * (len(pooled) - 1))], 3),
        "mean_ms": round(statistics.fmean(pooled), 3),
    }


def _parent(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        for mode in args.modes.split(","):
            found = figures(*_run_pair(args.url, mode, size, args.count))
            results[f"{mode}.{size}B"] = found
            print(
                f"{mode:<6} {size:>7} B  median {found['median_ms']:.3f} ms  "
                f"p99 {found['p99_ms']:.3f} ms  mean {found['mean_ms']:.3f} ms  "
                f"cpu {found['cpu_us_per_rank_exchange']:.0f} us per rank and exchange",
                flush=True,
            )
    if args.json is not None:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collective_hop")
    parser.add_argument("--url", default=os.environ.get(AMQP_URL_ENV, DEFAULT_AMQP_URL))
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--sizes", default="4096,131072", help="part bytes, comma-separated")
    parser.add_argument("--modes", default="hub,broker,lean,aiormq")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank", type=int, default=None, help="(run one side)")
    parser.add_argument("--run", default="")
    parser.add_argument("--mode", choices=sorted(RANK_MODES), default="hub")
    parser.add_argument("--bytes", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.rank is None:
        return _parent(args)
    side = RANK_MODES[args.mode](args.url, args.run, args.rank, args.bytes, args.count)
    with asyncio.Runner(loop_factory=configured_loop_factory()) as runner:
        cpu = time.process_time()
        timings = runner.run(side)
        cpu = time.process_time() - cpu
    print(json.dumps({"rank": args.rank, "ms": timings, "cpu_s": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
