"""StageWorker with a real slice (rank 0 of a 2-rank column split) and a fake wire."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.amqp.collective import CollectiveHub
from shardserve.errors import ErrorCode
from shardserve.tools.export.matmul import export_matmul
from shardserve.wire.protocol import CollectivePart, SchedulerHello, StageResult, StageWork
from shardserve.wire.tensors import DIGEST_PREFIX, Tensor, digest_tensors
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import LoadedSlice, load_slice
from shardserve_agent.worker import StageWorker


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedSlice:
    repo = tmp_path_factory.mktemp("repo")
    export_matmul(repo, rank_size=2, strategy="column")
    return load_slice(AgentSettings(repository=repo, servable="matmul", rank=0, use_cache=False))


class Fixture:
    def __init__(self, loaded: LoadedSlice) -> None:
        self.parts: list[CollectivePart] = []
        self.results: list[tuple[str, StageResult]] = []
        self.hub = CollectiveHub(rank=0, stage=0, stage_ranks=(0, 1), publish=self._part)
        self.worker = StageWorker(loaded, self.hub, self._result)

    async def _part(self, part: CollectivePart) -> None:
        self.parts.append(part)

    async def _result(self, to: str, result: StageResult) -> None:
        self.results.append((to, result))

    async def run(self, work: Any) -> None:
        await self.worker.handle(work, None)  # type: ignore[arg-type]


def work(job: str = "j1", deadline: float | None = None, **over: Any) -> StageWork:
    inputs = {"x": Tensor.from_numpy(np.ones((128, 96), dtype=np.float32))}
    fields: dict[str, Any] = dict(
        job=job,
        servable="matmul",
        version=1,
        stage=0,
        inputs=inputs,
        digest=digest_tensors(inputs),
        deadline=deadline or time.time() + 30,
        result_to="results",
    )
    return StageWork(**{**fields, **over})


def peer_part(job: str = "j1") -> CollectivePart:
    y_part = np.full((128, 8), -48.0, dtype=np.float32)
    return CollectivePart(job=job, stage=0, step=0, rank=1, tensor=Tensor.from_numpy(y_part))


async def test_leader_runs_the_stage_and_ships_outputs(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    f.hub.accept(peer_part())  # the peer was faster
    await f.run(work())
    [(to, result)] = f.results
    assert to == "results" and result.error is None and result.rank == 0
    assert result.outputs is not None
    y = result.outputs["y"].to_numpy()
    assert y.shape == (128, 16) and np.all(y == -48.0)
    assert result.digest == digest_tensors(result.outputs)
    assert [p.rank for p in f.parts] == [0]
    assert f.hub.is_finished("j1") and f.worker.inflight == 0
    stats = f.worker.stats()  # what the heartbeat carries
    assert stats.jobs_done == 1 and stats.inflight == 0
    assert stats.compute_ms_total == pytest.approx(result.compute_ms)
    assert stats.collective_ms_total == pytest.approx(result.collective_ms)


async def test_failed_jobs_are_not_counted_as_done(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(work(digest=DIGEST_PREFIX + "0" * 32))
    assert f.worker.stats().jobs_done == 0


async def test_expired_work_is_not_started(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(work(deadline=time.time() - 1))
    [(_, result)] = f.results
    assert result.error is not None and result.error.code == ErrorCode.DEADLINE
    assert f.parts == []


async def test_digest_mismatch_names_the_rank(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(work(digest=DIGEST_PREFIX + "0" * 32))
    [(_, result)] = f.results
    assert result.error is not None and result.error.code == ErrorCode.INTERNAL
    assert result.error.message == "rank 0: stage input digest mismatch (corrupted in transit?)"
    assert f.parts == []  # nothing ran


async def test_a_digest_of_another_version_is_named_as_such(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(work(digest="0" * 32))  # what a SHA-256 shardserve sent
    [(_, result)] = f.results
    assert result.error is not None and result.error.code == ErrorCode.INTERNAL
    assert result.error.message.startswith("rank 0: stage input digest '0000")
    assert "another shardserve version" in result.error.message


async def test_wrong_stage_is_refused(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(work(stage=1))
    [(_, result)] = f.results
    assert result.error is not None and "stage 1" in result.error.message


async def test_bad_input_shape_becomes_an_error_not_a_crash(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    inputs = {"x": Tensor.from_numpy(np.ones((3, 4), dtype=np.float32))}
    await f.run(work(inputs=inputs, digest=digest_tensors(inputs)))
    [(_, result)] = f.results
    assert result.error is not None and result.error.code == ErrorCode.INTERNAL
    assert result.error.message.startswith("rank 0 failed to run its stage")


async def test_cancelled_job_is_skipped(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    f.hub.cancel("j1", "already answered")
    await f.run(work())
    assert f.results == [] and f.parts == []


async def test_other_messages_are_dropped(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    await f.run(SchedulerHello(scheduler="s"))
    assert f.results == []


async def test_draining_answers_unavailable(loaded: LoadedSlice) -> None:
    f = Fixture(loaded)
    f.worker.draining = True
    await f.run(work())
    [(_, result)] = f.results
    assert result.error is not None and result.error.code == ErrorCode.UNAVAILABLE
    assert await f.worker.wait_idle(0)


def test_slice_loader_reads_only_its_rank(loaded: LoadedSlice) -> None:
    assert loaded.is_leader and loaded.stage.ranks == (0, 1)
    assert set(loaded.runners) == {"seg0.onnx"} and loaded.cache == "off"


def test_memory_cap_message(tmp_path: Path) -> None:
    from shardserve_agent import slice_loader

    assert slice_loader._is_allocation_failure(MemoryError())
    assert slice_loader._is_allocation_failure(RuntimeError("Failed to allocate memory"))
    assert not slice_loader._is_allocation_failure(RuntimeError("bad graph"))
