"""Builders for the scheduler's pure tests: groups, hellos, tensors, calls (no broker).
This folder is put on sys.path (tests run with --import-mode=importlib), so a test module
can use another's helpers (``test_core_guards`` those of ``test_serving_features``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.repo.repository import GroupConfig, RankSpec, RunOp, StageSpec, rank_checksum
from shardserve.wire.protocol import (
    AgentHeartbeat,
    AgentHello,
    InferRequest,
    StageResult,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve_scheduler.core.actions import PublishStageWork
from shardserve_scheduler.core.catalog import default_method
from shardserve_scheduler.core.requests import Call

sys.path.insert(0, str(Path(__file__).parent))


class Kit:
    """Factories shared by the scheduler unit tests."""

    @staticmethod
    def group(
        servable: str = "matmul", version: int = 1, rank_size: int = 2, stage_size: int = 1
    ) -> GroupConfig:
        per = rank_size // stage_size
        stages = tuple(
            StageSpec(
                index=s,
                ranks=tuple(range(s * per, (s + 1) * per)),
                inputs=("x",) if s == 0 else (f"h{s}",),
                outputs=("y",) if s == stage_size - 1 else (f"h{s + 1}",),
                program=(RunOp(file="seg.onnx"),),
            )
            for s in range(stage_size)
        )
        ranks = tuple(
            RankSpec(rank=r, stage=r // per, files=Kit.files(r), checksum=Kit.checksum(r))
            for r in range(rank_size)
        )
        spec_in = TensorSpec(name="x", datatype="FP32", shape=(2, 3))
        spec_out = TensorSpec(name="y", datatype="FP32", shape=(2, 3))
        return GroupConfig(
            servable=servable,
            version=version,
            rank_size=rank_size,
            stage_size=stage_size,
            inputs=(spec_in,),
            outputs=(spec_out,),
            stages=stages,
            ranks=ranks,
        )

    @staticmethod
    def files(rank: int) -> dict[str, str]:
        return {"seg.onnx": f"{rank:064x}"}

    @staticmethod
    def checksum(rank: int) -> str:
        return rank_checksum(Kit.files(rank))

    @staticmethod
    def hello(
        rank: int,
        instance: str | None = None,
        *,
        servable: str = "matmul",
        version: int = 1,
        stage: int | None = None,
        checksum: str | None = None,
        heartbeat: bool = False,
        per_stage: int = 2,
        state: str = "ready",
    ) -> Any:
        cls = AgentHeartbeat if heartbeat else AgentHello
        return cls(
            instance=instance or f"agent-{rank}",
            servable=servable,
            version=version,
            rank=rank,
            stage=rank // per_stage if stage is None else stage,
            slice_checksum=Kit.checksum(rank) if checksum is None else checksum,
            host="hostA",
            pid=1000 + rank,
            state=state,
        )

    @staticmethod
    def join(registry: Any, rank: int, now: float, instance: str | None = None, **kw: Any) -> None:
        """Hello, then the first heartbeat: what makes an accepted rank "ready"."""
        verdict = registry.hello(Kit.hello(rank, instance, **kw), now)
        assert verdict.accepted, verdict.reason
        assert registry.heartbeat(Kit.hello(rank, instance, heartbeat=True, **kw), now)

    @staticmethod
    def tensor(value: float = 1.0) -> Tensor:
        return Tensor.from_numpy(np.full((2, 3), value, np.float32))

    @staticmethod
    def request(
        rid: str = "req",
        *,
        instances: int = 1,
        deadline: float = 100.0,
        version: int = 0,
        servable: str = "matmul",
        method: str = "predict",
        outputs: tuple[str, ...] | None = None,
    ) -> InferRequest:
        return InferRequest(
            id=rid,
            servable=servable,
            version=version,
            method=method,
            instances=tuple({"x": Kit.tensor(float(i))} for i in range(instances)),
            deadline=deadline,
            outputs=outputs,
        )

    @staticmethod
    def call(group: GroupConfig, request: InferRequest, correlation: str = "c1") -> Call:
        return Call(request, "reply.q", correlation, group, default_method(group))

    @staticmethod
    def result(
        work: PublishStageWork,
        rank: int,
        group: GroupConfig,
        *,
        value: float | None = None,
        error: Any = None,
        shape: tuple[int, ...] | None = None,
    ) -> StageResult:
        """A rank's answer to a stage: outputs = inputs + 1 (or ``value``, in ``shape`` if
        given), the leader ships them."""
        w = work.work
        if error is not None:
            return StageResult(
                job=w.job,
                servable=w.servable,
                version=w.version,
                stage=w.stage,
                rank=rank,
                error=error,
            )
        source = next(iter(w.inputs.values())).to_numpy()
        out_name = group.stages[w.stage].outputs[0]
        array = np.full_like(source, value) if value is not None else source + 1
        if shape is not None:
            array = np.full(shape, value or 0.0, dtype=source.dtype)
        outputs = {out_name: Tensor.from_numpy(array)}
        leader = group.leader_of(w.stage)
        return StageResult(
            job=w.job,
            servable=w.servable,
            version=w.version,
            stage=w.stage,
            rank=rank,
            digest=digest_tensors(outputs),
            outputs=outputs if rank == leader else None,
        )


@pytest.fixture
def kit() -> Kit:
    return Kit()
