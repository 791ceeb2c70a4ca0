"""Collective buffering over a fake publisher: early parts, rank order, deadline, cancel."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardserve.collective import CollectiveHub, JobCancelledError
from shardserve.errors import DeadlineError
from shardserve.protocol import CollectivePart
from shardserve.tensors import Tensor


class ManualClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Wire:
    """Records what the hub publishes."""

    def __init__(self) -> None:
        self.sent: list[CollectivePart] = []

    async def __call__(self, part: CollectivePart) -> None:
        self.sent.append(part)


def make_hub(
    rank: int = 1, ranks: tuple[int, ...] = (0, 1, 2), **kw: object
) -> tuple[CollectiveHub, Wire, ManualClock]:
    wire, clock = Wire(), ManualClock()
    hub = CollectiveHub(
        rank=rank,
        stage=0,
        stage_ranks=ranks,
        publish=wire,
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )
    return hub, wire, clock


def part(job: str, step: int, rank: int, value: float, stage: int = 0) -> CollectivePart:
    array = np.full((2, 1), value, dtype=np.float32)
    return CollectivePart(
        job=job, stage=stage, step=step, rank=rank, tensor=Tensor.from_numpy(array)
    )


def own(value: float) -> np.ndarray:
    return np.full((2, 1), value, dtype=np.float32)


async def test_early_parts_are_buffered_and_combined_in_rank_order() -> None:
    hub, wire, _ = make_hub(rank=1)
    hub.accept(part("j1", 0, 2, 2.0))  # before the job started here
    hub.accept(part("j1", 0, 0, 0.0))
    parts = await hub.begin("j1", deadline=2000.0).gather(0, own(1.0))
    assert [float(p[0, 0]) for p in parts] == [0.0, 1.0, 2.0]
    assert [(p.job, p.step, p.rank) for p in wire.sent] == [("j1", 0, 1)]
    np.testing.assert_array_equal(wire.sent[0].tensor.to_numpy(), own(1.0))


async def test_waits_for_late_parts() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    waiting = asyncio.create_task(hub.begin("j", deadline=2000.0).gather(0, own(5.0)))
    await asyncio.sleep(0)
    assert not waiting.done()
    hub.accept(part("j", 0, 1, 6.0))
    parts = await asyncio.wait_for(waiting, 5)
    assert [float(p[0, 0]) for p in parts] == [5.0, 6.0]


async def test_steps_do_not_mix() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    hub.accept(part("j", 1, 1, 9.0))
    hub.accept(part("j", 0, 1, 3.0))
    job = hub.begin("j", deadline=2000.0)
    assert float((await job.gather(0, own(0.0)))[1][0, 0]) == 3.0
    assert float((await job.gather(1, own(0.0)))[1][0, 0]) == 9.0


async def test_deadline_names_the_missing_ranks() -> None:
    hub, _, clock = make_hub(rank=1, ranks=(0, 1, 2, 3))
    hub.accept(part("j", 0, 2, 2.0))
    clock.now = 2000.5
    with pytest.raises(DeadlineError, match=r"rank\(s\) 0, 3") as info:
        await hub.begin("j", deadline=2000.0).gather(0, own(1.0))
    assert "step 0" in info.value.message and "job j" in info.value.message


async def test_real_timeout_when_a_peer_never_answers() -> None:
    import time

    hub = CollectiveHub(rank=0, stage=0, stage_ranks=(0, 1), publish=Wire())
    with pytest.raises(DeadlineError, match=r"rank\(s\) 1"):
        await hub.begin("j", deadline=time.time() + 0.05).gather(0, own(1.0))


async def test_cancel_aborts_a_waiting_job() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    waiting = asyncio.create_task(hub.begin("j", deadline=2000.0).gather(0, own(1.0)))
    await asyncio.sleep(0)
    assert hub.cancel("j", "rank 1 lost")
    with pytest.raises(JobCancelledError, match="rank 1 lost"):
        await asyncio.wait_for(waiting, 5)


async def test_cancel_before_start_marks_the_job_finished() -> None:
    hub, _, _ = make_hub()
    assert not hub.cancel("j", "timed out")
    assert hub.is_finished("j")


async def test_parts_of_finished_jobs_are_dropped() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    hub.accept(part("old", 0, 1, 1.0))
    hub.finish("old")
    hub.accept(part("old", 0, 1, 1.0))  # a straggler
    assert "old" not in hub._pending


async def test_foreign_and_own_parts_are_ignored() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    hub.accept(part("j", 0, 0, 1.0))  # own part echoed by the broker
    hub.accept(part("j", 0, 7, 1.0))  # not a rank of this stage
    hub.accept(part("j", 0, 1, 1.0, stage=3))  # another stage
    assert hub._pending == {}


async def test_buffer_of_never_started_jobs_is_bounded() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1), max_pending_jobs=3)
    for i in range(10):
        hub.accept(part(f"j{i}", 0, 1, float(i)))
    assert list(hub._pending) == ["j7", "j8", "j9"]


async def test_finished_set_is_bounded() -> None:
    hub, _, _ = make_hub(finished_limit=2)
    for job in ("a", "b", "c"):
        hub.finish(job)
    assert not hub.is_finished("a") and hub.is_finished("c")


# ----------------------------------------------------------------- algorithms


class Stage:
    """In-process transport for the hubs of one stage: multicast and point-to-point,
    counting deliveries (a multicast reaches every hub, the sender's own included)."""

    def __init__(self, ranks: tuple[int, ...], point_to_point: bool) -> None:
        self.deliveries = 0
        self.hubs = {
            r: CollectiveHub(
                rank=r,
                stage=0,
                stage_ranks=ranks,
                publish=self._multicast,
                send_to=self._send if point_to_point else None,
            )
            for r in ranks
        }

    async def _multicast(self, part: CollectivePart) -> None:
        for hub in self.hubs.values():
            self.deliveries += 1
            hub.accept(part)

    async def _send(self, rank: int, part: CollectivePart) -> None:
        self.deliveries += 1
        self.hubs[rank].accept(part)

    async def allreduce(self, job: str, arrays: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        def total(parts: list[np.ndarray]) -> np.ndarray:
            out = parts[0].copy()
            for p in parts[1:]:
                out += p
            return out

        async def one(rank: int) -> np.ndarray:
            collective = self.hubs[rank].begin(job, deadline=float("inf"))
            return await collective.allcombine(0, arrays[rank], total)

        results = await asyncio.gather(*(one(r) for r in self.hubs))
        return dict(zip(self.hubs, results, strict=True))


@pytest.mark.parametrize(
    ("ranks", "point_to_point", "algorithm"),
    [(2, True, "fanout"), (3, True, "leader"), (8, True, "leader"), (8, False, "fanout")],
)
def test_the_algorithm_depends_on_the_rank_count_and_transport(
    ranks: int, point_to_point: bool, algorithm: str
) -> None:
    assert Stage(tuple(range(ranks)), point_to_point).hubs[0].algorithm == algorithm


@pytest.mark.parametrize("point_to_point", [True, False])
async def test_both_algorithms_agree_bit_for_bit_on_every_rank(point_to_point: bool) -> None:
    ranks = tuple(range(8))
    stage = Stage(ranks, point_to_point)
    rng = np.random.default_rng(7)
    arrays = {r: rng.standard_normal((4, 3)).astype(np.float32) for r in ranks}
    results = await stage.allreduce("job-a", arrays)
    expected = arrays[0].copy()
    for r in ranks[1:]:
        expected += arrays[r]  # rank order, as combine does
    for result in results.values():
        assert result.tobytes() == expected.tobytes()
    # leader: 7 sends to the leader + one multicast to 8 queues; fanout: 8 multicasts.
    assert stage.deliveries == (7 + 8 if point_to_point else 8 * 8)


async def test_leader_results_that_arrive_before_the_rank_starts_are_kept() -> None:
    stage = Stage((0, 1, 2), point_to_point=True)
    leader = stage.hubs[0].begin("job-b", deadline=float("inf"))
    stage.hubs[0].accept(part("job-b", 0, 1, 1.0))
    stage.hubs[0].accept(part("job-b", 0, 2, 2.0))
    combined = await leader.allcombine(0, own(4.0), lambda ps: np.concatenate(ps, axis=1))
    assert combined.tolist() == [[4.0, 1.0, 2.0], [4.0, 1.0, 2.0]]
    # rank 2 starts late: the leader's combined part is already buffered for it
    late = stage.hubs[2].begin("job-b", deadline=float("inf"))
    got = await late.allcombine(0, own(2.0), lambda ps: np.concatenate(ps, axis=1))
    assert got.tobytes() == combined.tobytes()
