"""OrtSegment runs short segments inline on the event loop, long or grown ones in a thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from shardserve.runtime import program
from shardserve.runtime.program import OrtSegment


class ManualClock:
    """Stands in for ``time`` in shardserve.runtime.program: a run costs exactly what the fake
    session says, however busy the machine running the tests is."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    manual = ManualClock()
    monkeypatch.setattr(program, "time", manual)
    return manual


class FakeSession:
    """Records the thread each run happens in; each run costs ``busy_s`` on the clock."""

    def __init__(self, clock: ManualClock, busy_s: float) -> None:
        self.clock = clock
        self.busy_s = busy_s
        self.threads: list[int] = []

    def get_inputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name="x")]

    def get_outputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name="y")]

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.threads.append(threading.get_ident())
        self.clock.now += self.busy_s
        return [feeds["x"] * 2]


async def test_a_short_segment_runs_inline_after_its_first_threaded_run(clock: ManualClock) -> None:
    session = FakeSession(clock, busy_s=0.0)
    segment = OrtSegment(session)
    x = np.ones(4, np.float32)
    for _ in range(3):
        assert (await segment.run({"x": x}))["y"].tolist() == [2.0] * 4
    loop_thread = threading.get_ident()
    assert session.threads[0] != loop_thread  # unknown cost: threaded
    assert session.threads[1:] == [loop_thread, loop_thread]


async def test_a_long_segment_stays_in_a_thread(clock: ManualClock) -> None:
    session = FakeSession(clock, busy_s=5 * program.INLINE_RUN_S)
    segment = OrtSegment(session)
    x = np.ones(4, np.float32)
    for _ in range(3):
        await segment.run({"x": x})
    assert threading.get_ident() not in session.threads


async def test_much_bigger_feeds_go_back_to_a_thread(clock: ManualClock) -> None:
    session = FakeSession(clock, busy_s=0.0)
    segment = OrtSegment(session)
    await segment.run({"x": np.ones(4, np.float32)})
    await segment.run({"x": np.ones(4, np.float32)})
    await segment.run({"x": np.ones(4000, np.float32)})  # a bigger batch: cost unknown
    loop_thread = threading.get_ident()
    assert [t == loop_thread for t in session.threads] == [False, True, False]


async def test_the_instances_of_a_stacked_job_share_one_thread_hop_or_stay_inline(
    clock: ManualClock,
) -> None:
    session = FakeSession(clock, busy_s=program.INLINE_RUN_S / 5)  # a fifth of the limit
    segment = OrtSegment(session)
    x = np.ones(4, np.float32)
    await segment.run({"x": x})  # cost unknown: threaded; now known as a fifth
    loop_thread = threading.get_ident()
    session.threads.clear()
    three = await segment.run_each([{"x": x * i} for i in range(3)])  # 3/5: inline
    assert [out["y"].tolist() for out in three] == [[0.0] * 4, [2.0] * 4, [4.0] * 4]
    assert session.threads == [loop_thread] * 3
    session.threads.clear()
    await segment.run_each([{"x": x}] * 8)  # 8/5 together: all in one worker thread
    assert len(set(session.threads)) == 1 and session.threads[0] != loop_thread
    assert len(session.threads) == 8
