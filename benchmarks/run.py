"""One benchmark run: its settings, scratch space and results (every scenario module
takes one; scenarios, gen_scenario and gen_bar import it from here)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadResult, LoadSpec
from benchmarks.meshes import Mesh, running_mesh


@dataclass
class Run:
    """One benchmark run: settings, scratch space, and everything measured so far."""

    quick: bool
    amqp_url: str
    work: Path
    gateways: int = 1  # gateway processes per mesh (``shardserve up --gateways``)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _repos: dict[str, Path] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        path = self.work / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def spec(self, concurrency: int, scale: float = 1.0) -> LoadSpec:
        warmup, duration = (1.0, 3.0) if self.quick else (2.0, 10.0)
        return LoadSpec(concurrency, duration * scale, warmup)

    def record(self, key: str, result: LoadResult, **meta: Any) -> None:
        # The 1-minute load average after the measurement: above the CPU count, other
        # work shared the machine and the absolute figures (not only ratios) suffer.
        load = round(os.getloadavg()[0], 2)
        self.results[key] = {**result.to_json(), **meta, "loadavg_1m": load}
        rps = f"{result.rps:9.1f} req/s"
        lat = f"p50 {result.p50_ms:8.2f} ms  p99 {result.p99_ms:8.2f} ms"
        err = f"  errors {result.errors} ({result.first_error[:120]})" if result.errors else ""
        print(f"  {key:<28} {rps}  {lat}{err}", flush=True)

    def mesh(
        self, repo: Path, env: dict[str, str] | None = None, *, grpc: bool = False
    ) -> AbstractContextManager[Mesh]:
        """``shardserve up REPO`` with this run's gateway count, until the block ends
        (``grpc``: its gateway serves gRPC too, on ``mesh.grpc_port``)."""
        return running_mesh(
            repo, self.amqp_url, self.logs, env=env, gateways=self.gateways, grpc=grpc
        )

    def repo(self, key: str, build: Callable[[Path], object]) -> Path:
        """An exported repository, built once per run."""
        if key not in self._repos:
            path = self.work / "repos" / key
            build(path)
            self._repos[key] = path
        return self._repos[key]
