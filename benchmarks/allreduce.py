"""One rank of the allreduce benchmark: the agents' collective code over RabbitMQ, alone.

R of these processes (one per rank, as agents run) meet on a run id, then each runs
``--count`` allreduces of ``--bytes`` bytes (fp32, one step per job, like a tensor
parallel layer's partial sums) with the algorithm forced on every rank: ``leader`` (one
rank sums, then multicasts) or ``sharded`` (reduce-scatter + allgather). It prints one
JSON line: the wall milliseconds of each allreduce, from entering the collective to
holding the sum (the ranks start each job together: every job begins once the previous
one ended everywhere, since it needs every rank's part).

    python -m benchmarks.allreduce --url AMQP_URL --run RUN --group-dir VERSION_DIR \
        --rank R --bytes N --count K --algorithm leader|sharded

The scenario (``benchmarks.scenarios.allreduce``) starts the ranks and compares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from shardserve.amqp.collective import sum_in_rank_order
from shardserve.lite.wire import RunMesh
from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.settings import BrokerSettings
from shardserve.repo.repository import load_group

NEVER = 2**62  # a min_shard_bytes no part reaches: the leader algorithm


async def run_rank(args: argparse.Namespace) -> list[float]:
    version_dir = Path(args.group_dir)
    group = load_group(version_dir.parent.parent, version_dir.parent.name, int(version_dir.name))
    threshold = 0 if args.algorithm == "sharded" else NEVER
    settings = BrokerSettings(urls=(args.url,))
    mesh = RunMesh(settings, args.run, group, args.rank, min_shard_bytes=threshold)
    await mesh.open()
    try:
        await mesh.rendezvous(60.0)
        return await _allreduces(mesh, args.bytes // 4, args.count, len(group.ranks))
    finally:
        await mesh.close()


async def _allreduces(mesh: RunMesh, elements: int, count: int, ranks: int) -> list[float]:
    part = np.full(elements, float(mesh.rank + 1), dtype=np.float32)
    expected = sum_in_rank_order([np.full(1, float(r + 1), np.float32) for r in range(ranks)])
    timings: list[float] = []
    for n in range(count):
        job = f"{mesh.run}:{n}"
        started = time.perf_counter()
        collective = mesh.hub.begin(job, deadline=time.time() + 120.0)
        total = await collective.allreduce(0, part)
        timings.append((time.perf_counter() - started) * 1000)
        mesh.hub.finish(job)
        if total.shape != part.shape or float(total[-1]) != float(expected[0]):
            raise RuntimeError(f"rank {mesh.rank}: wrong sum in job {job}")
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce")
    parser.add_argument("--url", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--group-dir", required=True, help="an exported version folder")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--algorithm", choices=("leader", "sharded"), required=True)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=configured_loop_factory()) as runner:
        timings = runner.run(run_rank(args))
    print(json.dumps({"rank": args.rank, "ms": timings}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
