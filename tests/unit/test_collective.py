"""Collective buffering over a fake publisher: early parts, rank order, deadline, cancel;
the algorithms over an in-process transport, and a stage's final collectives."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from shardserve.amqp.collective import CollectiveHub, JobCancelledError
from shardserve.errors import DeadlineError
from shardserve.repo.repository import AllGatherOp, AllReduceOp, RunOp, StageSpec
from shardserve.runtime.program import run_stage
from shardserve.wire.parts import Part
from shardserve.wire.protocol import CollectivePart
from shardserve.wire.tensors import Tensor


class ManualClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Wire:
    """Records what the hub publishes."""

    def __init__(self) -> None:
        self.sent: list[Part] = []

    async def __call__(self, part: Part) -> None:
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


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until ``condition`` holds (a step that follows then meets
    the state it is meant to test, however the loop ran); fail after 5 s."""
    async with asyncio.timeout(5):
        # no event tells a coroutine's state: yield to the loop until the condition holds
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0)


def waiting(task: asyncio.Task[Any]) -> Callable[[], bool]:
    """Whether ``task`` runs and is suspended: here, waiting for its peers' parts."""
    coroutine = task.get_coro()
    assert inspect.iscoroutine(coroutine)
    return lambda: inspect.getcoroutinestate(coroutine) == inspect.CORO_SUSPENDED


async def test_early_parts_are_buffered_and_combined_in_rank_order() -> None:
    hub, wire, _ = make_hub(rank=1)
    hub.accept(part("j1", 0, 2, 2.0))  # before the job started here
    hub.accept(part("j1", 0, 0, 0.0))
    parts = await hub.begin("j1", deadline=2000.0).gather(0, own(1.0))
    assert [float(p[0, 0]) for p in parts] == [0.0, 1.0, 2.0]
    assert [(p.job, p.step, p.rank) for p in wire.sent] == [("j1", 0, 1)]
    np.testing.assert_array_equal(wire.sent[0].array, own(1.0))


async def test_waits_for_late_parts() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1))
    gathering = asyncio.create_task(hub.begin("j", deadline=2000.0).gather(0, own(5.0)))
    await until(waiting(gathering))
    hub.accept(part("j", 0, 1, 6.0))
    parts = await asyncio.wait_for(gathering, 5)
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
    gathering = asyncio.create_task(hub.begin("j", deadline=2000.0).gather(0, own(1.0)))
    await until(waiting(gathering))
    assert hub.cancel("j", "rank 1 lost")
    with pytest.raises(JobCancelledError, match="rank 1 lost"):
        await asyncio.wait_for(gathering, 5)


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


async def test_lean_parts_count_as_messages_do_and_a_malformed_message_is_dropped() -> None:
    hub, _, _ = make_hub(rank=0, ranks=(0, 1, 2))
    collective = hub.begin("j", deadline=float("inf"))
    hub.accept(Part("j", 0, 0, 1, "part", own(1.0)))  # lean, as the link decodes it
    broken = Tensor.model_construct(dtype="<f4", shape=(2, 1), data=b"\0" * 7)
    hub.accept(CollectivePart.model_construct(job="j", stage=0, step=0, rank=2, tensor=broken))
    assert set(hub.parts("j", 0)) == {1}
    hub.accept(part("j", 0, 2, 2.0))
    result = await collective.allcombine(0, own(0.0), lambda ps: np.concatenate(ps, axis=1))
    assert result.tolist() == [[0.0, 1.0, 2.0]] * 2


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

    def __init__(
        self, ranks: tuple[int, ...], point_to_point: bool, min_shard_bytes: int = 2**40
    ) -> None:
        self.deliveries = 0
        self.sent_to = dict.fromkeys(ranks, 0)  # point-to-point parts, by receiving rank
        self.hubs = {
            r: CollectiveHub(
                rank=r,
                stage=0,
                stage_ranks=ranks,
                publish=self._multicast,
                send_to=self._send if point_to_point else None,
                min_shard_bytes=min_shard_bytes,
            )
            for r in ranks
        }

    async def _multicast(self, part: Part) -> None:
        for hub in self.hubs.values():
            self.deliveries += 1
            hub.accept(part)

    async def _send(self, rank: int, part: Part) -> None:
        self.deliveries += 1
        self.sent_to[rank] += 1
        self.hubs[rank].accept(part)

    async def allreduce(self, job: str, arrays: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        async def one(rank: int) -> np.ndarray:
            collective = self.hubs[rank].begin(job, deadline=float("inf"))
            return await collective.allreduce(0, arrays[rank])

        results = await asyncio.gather(*(one(r) for r in self.hubs))
        return dict(zip(self.hubs, results, strict=True))


def summed_in_rank_order(arrays: dict[int, np.ndarray]) -> np.ndarray:
    expected = arrays[0].copy()
    for r in sorted(arrays)[1:]:
        expected += arrays[r]
    return expected


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
    expected = summed_in_rank_order(arrays)  # rank order, as combine does
    for result in results.values():
        assert result.tobytes() == expected.tobytes()
    # leader: 7 sends to the leader + one multicast to 8 queues; fanout: 8 multicasts.
    assert stage.deliveries == (7 + 8 if point_to_point else 8 * 8)


async def test_fanout_sends_each_peer_its_part_where_it_can_and_never_back_to_itself() -> None:
    """At 2 ranks a multicast would reach the sender's own queue too: 4 deliveries for 2
    useful ones. Point-to-point, each rank's part goes to its peer only."""
    arrays = {r: np.full(3, float(r + 1), np.float32) for r in (0, 1)}
    direct, multicast = Stage((0, 1), point_to_point=True), Stage((0, 1), point_to_point=False)
    for stage in (direct, multicast):
        results = await stage.allreduce("job-f", arrays)
        assert all(r.tolist() == [3.0] * 3 for r in results.values())
    assert (direct.deliveries, direct.sent_to) == (2, {0: 1, 1: 1})
    assert multicast.deliveries == 4


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


# ----------------------------------------------------------------- sharded allreduce


@pytest.mark.parametrize(
    ("ranks", "point_to_point", "nbytes", "algorithm"),
    [
        (3, True, 3 * 1024, "sharded"),  # shards of 1 KiB: the minimum (test hubs: 1 KiB)
        (3, True, 3 * 1024 - 4, "leader"),
        (8, True, 8 * 1024, "sharded"),
        (8, True, 4 * 1024, "leader"),  # the same part is too small for 8 shards
        (3, True, None, "leader"),  # an allgather is never sharded
        (2, True, 10**9, "fanout"),  # 2 ranks: fanout is best at any size
        (8, False, 10**9, "fanout"),  # no point-to-point sends: no shards
    ],
)
def test_big_allreduces_from_3_ranks_are_sharded(
    ranks: int, point_to_point: bool, nbytes: int | None, algorithm: str
) -> None:
    hub = Stage(tuple(range(ranks)), point_to_point, min_shard_bytes=1024).hubs[0]
    assert hub.algorithm_for(nbytes) == algorithm


def test_the_default_minimum_is_a_mebibyte_per_shard() -> None:
    hub = Stage((0, 1, 2, 3), point_to_point=True).hubs[0]
    default = CollectiveHub(rank=0, stage=0, stage_ranks=(0, 1, 2, 3), publish=hub.publish)
    default_p2p = CollectiveHub(
        rank=0, stage=0, stage_ranks=(0, 1, 2, 3), publish=hub.publish, send_to=hub.send_to
    )
    assert default.algorithm_for(2**30) == "fanout"
    assert default_p2p.algorithm_for(4 * 2**20) == "sharded"
    assert default_p2p.algorithm_for(4 * 2**20 - 4) == "leader"


@pytest.mark.parametrize("ranks", [3, 4, 8])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 11), (1,)])
async def test_sharded_allreduce_gives_the_leaders_bits_on_every_rank(
    ranks: int, shape: tuple[int, ...]
) -> None:
    """Shards of uneven sizes (35, 66 and 1 elements over 3, 4 and 8 ranks; some empty),
    summed in rank order by their owner: bit for bit what the leader computes."""
    rng = np.random.default_rng(ranks)
    arrays = {r: rng.standard_normal(shape).astype(np.float32) for r in range(ranks)}
    sharded = Stage(tuple(range(ranks)), point_to_point=True, min_shard_bytes=0)
    leader = Stage(tuple(range(ranks)), point_to_point=True)
    got = await sharded.allreduce("job-s", arrays)
    reference = await leader.allreduce("job-s", arrays)
    expected = summed_in_rank_order(arrays)
    for rank in range(ranks):
        assert got[rank].shape == shape
        assert got[rank].tobytes() == expected.tobytes() == reference[rank].tobytes()
        assert sharded.hubs[rank].runs == {"sharded": 1}
        assert leader.hubs[rank].runs == {"leader": 1}
    # R-1 shards sent by each rank, then each summed shard multicast to all R queues.
    assert sharded.deliveries == ranks * (ranks - 1) + ranks * ranks


async def test_shards_that_arrive_before_the_rank_starts_are_kept() -> None:
    stage = Stage((0, 1, 2), point_to_point=True, min_shard_bytes=0)
    arrays = {r: np.full(6, float(r + 1), dtype=np.float32) for r in range(3)}
    early = asyncio.gather(
        *(stage.hubs[r].begin("j", float("inf")).allreduce(0, arrays[r]) for r in (0, 1))
    )
    task = asyncio.ensure_future(early)
    await until(lambda: stage.sent_to[2] == 2)  # ranks 0 and 1 sent rank 2 their shards
    assert not task.done()  # they wait for rank 2's, which has not begun
    late = await stage.hubs[2].begin("j", float("inf")).allreduce(0, arrays[2])
    for result in [*(await task), late]:
        assert result.tolist() == [6.0] * 6


async def test_a_missing_shard_reaches_the_deadline_naming_the_rank() -> None:
    hub, wire, clock = make_hub(rank=0, ranks=(0, 1, 2), send_to=_Outbox(), min_shard_bytes=0)
    collective = hub.begin("j", deadline=clock.now + 5)
    hub.accept(
        CollectivePart(
            job="j", stage=0, step=0, rank=1, phase="shard", tensor=Tensor.from_numpy(own(1.0))
        )
    )
    task = asyncio.ensure_future(collective.allreduce(0, np.ones(6, dtype=np.float32)))
    await until(waiting(task))
    clock.now += 10
    collective.changed.set()
    with pytest.raises(DeadlineError, match="rank\\(s\\) 2"):
        await task
    assert wire.sent == []  # nothing summed, nothing multicast


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Part]] = []

    async def __call__(self, rank: int, part: Part) -> None:
        self.sent.append((rank, part))


# ----------------------------------------------------------------- final collectives at the leader


async def _to_leader(
    stage: Stage, job: str, arrays: dict[int, np.ndarray], *, reduce: bool
) -> dict[int, np.ndarray | None]:
    def join(parts: list[np.ndarray]) -> np.ndarray:
        return summed_in_rank_order(dict(enumerate(parts))) if reduce else np.concatenate(parts)

    async def one(rank: int) -> np.ndarray | None:
        collective = stage.hubs[rank].begin(job, deadline=float("inf"))
        return await collective.to_leader(0, arrays[rank], join, reduce=reduce)

    results = await asyncio.gather(*(one(r) for r in stage.hubs))
    return dict(zip(stage.hubs, results, strict=True))


@pytest.mark.parametrize(
    ("min_shard_bytes", "reduce", "algorithm", "deliveries"),
    [
        (2**40, False, "to-leader", 7),  # an allgather: 7 parts to the leader, no multicast
        (2**40, True, "to-leader", 7),  # a small allreduce: the same
        (0, True, "sharded-to-leader", 8 * 7 + 7),  # shards to their owners, sums to the leader
    ],
)
async def test_final_collectives_combine_at_the_leader_alone(
    min_shard_bytes: int, reduce: bool, algorithm: str, deliveries: int
) -> None:
    """The leader gets what allcombine/allreduce give every rank, bit for bit; the other
    ranks send their part and get nothing back."""
    ranks = tuple(range(8))
    rng = np.random.default_rng(11)
    arrays = {r: rng.standard_normal((3, 5)).astype(np.float32) for r in ranks}
    stage = Stage(ranks, point_to_point=True, min_shard_bytes=min_shard_bytes)
    got = await _to_leader(stage, "job-f", arrays, reduce=reduce)
    ordered = [arrays[r] for r in ranks]
    expected = summed_in_rank_order(arrays) if reduce else np.concatenate(ordered)
    leader_result = got[0]
    assert leader_result is not None and leader_result.tobytes() == expected.tobytes()
    assert all(got[r] is None for r in ranks[1:])
    assert stage.deliveries == deliveries
    assert all(stage.hubs[r].runs == {algorithm: 1} for r in ranks)


async def test_without_point_to_point_sends_every_rank_still_gets_the_result() -> None:
    ranks = (0, 1, 2)
    arrays = {r: np.full(4, float(r), dtype=np.float32) for r in ranks}
    got = await _to_leader(Stage(ranks, point_to_point=False), "job-g", arrays, reduce=False)
    for result in got.values():
        assert result is not None and result.tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4


async def test_a_leader_missing_a_final_part_names_the_rank_at_the_deadline() -> None:
    hub, wire, clock = make_hub(rank=0, ranks=(0, 1, 2), send_to=_Outbox())
    hub.accept(part("j", 0, 2, 2.0))
    collective = hub.begin("j", deadline=clock.now + 5)
    task = asyncio.ensure_future(collective.to_leader(0, own(0.0), np.concatenate, reduce=False))
    await until(waiting(task))
    clock.now += 10
    collective.changed.set()
    with pytest.raises(DeadlineError, match="rank\\(s\\) 1"):
        await task
    assert wire.sent == []  # the leader multicasts nothing


def _stage_spec(program: tuple[object, ...], outputs: tuple[str, ...] = ("y",)) -> StageSpec:
    return StageSpec(index=0, ranks=(0, 1, 2), inputs=("x",), outputs=outputs, program=program)


RUN = RunOp(file="seg.onnx")


@pytest.mark.parametrize(
    ("program", "outputs", "finals"),
    [
        ((RUN, AllGatherOp(input="p", output="y", axis=1)), ("y",), {1}),
        ((RUN, AllReduceOp(input="p", output="y")), ("y",), {1}),
        # two trailing collectives: only the one whose result is the stage output
        (
            (RUN, AllReduceOp(input="p", output="q"), AllGatherOp(input="q", output="y", axis=0)),
            ("y",),
            {2},
        ),
        (
            (
                RUN,
                AllGatherOp(input="p", output="y", axis=0),
                AllGatherOp(input="p", output="z", axis=1),
            ),
            ("y", "z"),
            {1, 2},
        ),
        # a segment runs after the collective: every rank needs its result
        ((AllGatherOp(input="x", output="g", axis=0), RUN), ("y",), set()),
        # a stage output read by a later collective is needed on every rank
        (
            (
                RUN,
                AllGatherOp(input="p", output="q", axis=0),
                AllGatherOp(input="q", output="y", axis=0),
            ),
            ("q", "y"),
            set(),
        ),
        # one output from a segment: a rank would hold some outputs, not none
        ((RUN, AllGatherOp(input="p", output="y", axis=0)), ("y", "p"), set()),
        ((RUN,), ("y",), set()),
    ],
)
def test_final_collectives_are_those_whose_results_are_only_stage_outputs(
    program: tuple[object, ...], outputs: tuple[str, ...], finals: set[int]
) -> None:
    assert _stage_spec(program, outputs).final_collectives == finals


class _Scale:
    """A segment: p = x * factor (one per rank, so the parts differ)."""

    input_names: tuple[str, ...] = ("x",)

    def __init__(self, factor: float) -> None:
        self._factor = factor

    async def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"p": feeds["x"] * self._factor}

    async def run_each(
        self, feed_list: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]]:
        return [await self.run(feeds) for feeds in feed_list]


@pytest.mark.parametrize("outputs_at_leader", [True, False])
async def test_a_stage_ending_in_an_allgather_has_outputs_at_the_leader_only(
    outputs_at_leader: bool,
) -> None:
    spec = _stage_spec((RUN, AllGatherOp(input="p", output="y", axis=1)))
    stage = Stage((0, 1, 2), point_to_point=True)
    x = np.arange(4, dtype=np.float32).reshape(2, 2)

    async def rank(r: int) -> dict[str, np.ndarray]:
        collective = stage.hubs[r].begin("job-r", deadline=float("inf"))
        runners = {"seg.onnx": _Scale(r + 1.0)}
        return await run_stage(
            spec, runners, {"x": x}, collective, outputs_at_leader=outputs_at_leader
        )

    results = await asyncio.gather(*(rank(r) for r in (0, 1, 2)))
    expected = np.concatenate([x, 2 * x, 3 * x], axis=1)
    assert results[0]["y"].tobytes() == expected.tobytes()
    for other in results[1:]:
        if outputs_at_leader:
            assert other == {}
        else:
            assert other["y"].tobytes() == expected.tobytes()
    assert stage.deliveries == (2 if outputs_at_leader else 2 + 3)
