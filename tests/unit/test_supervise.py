"""Process supervision: back-off arithmetic (pure) and real tiny child processes (restart,
final exit codes, prefixed output, SIGTERM then SIGKILL of the whole process group)."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path

from shardserve.process.supervise import Backoff, ChildSpec, Supervised, describe_exit


def test_backoff_doubles_up_to_the_cap() -> None:
    backoff = Backoff(initial=1, cap=30, healthy_after=60)
    assert [backoff.delay_after(0.5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_backoff_resets_after_a_healthy_run() -> None:
    backoff = Backoff(initial=1, cap=30, healthy_after=60)
    for _ in range(4):
        backoff.delay_after(1)
    assert backoff.delay_after(59.9) == 16
    assert backoff.delay_after(60) == 1
    assert backoff.delay_after(2) == 2


def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "was killed by SIGKILL"


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def fast_backoff() -> Backoff:
    return Backoff(initial=0.01, cap=0.02, healthy_after=60)


async def test_a_crashing_child_is_restarted_and_output_is_prefixed(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code = (
        f"import pathlib, sys; p = pathlib.Path({str(runs)!r}); "
        "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "
        "print('run', n + 1, flush=True); sys.exit(0 if n + 1 >= 3 else 1)"
    )
    out = io.StringIO()
    # Exit 0 is "final" here only so the test ends after the third run.
    child = Supervised(
        ChildSpec("agent m r1", python(code), final_codes=frozenset({0})),
        backoff=fast_backoff(),
        out=out,
    )
    await asyncio.wait_for(child.run(), 30)
    assert child.starts == 3
    assert child.final_code == 0
    lines = out.getvalue().splitlines()
    assert "[agent m r1] run 1" in lines
    assert "[agent m r1] exited with code 1; restarting in 0.01 s" in lines
    assert lines[-1] == "[agent m r1] exited with code 0; not restarting"


async def test_registration_refused_is_not_restarted() -> None:
    out = io.StringIO()
    child = Supervised(
        ChildSpec("agent m r0", python("import sys; sys.exit(3)"), frozenset({2, 3})),
        backoff=fast_backoff(),
        out=out,
    )
    await asyncio.wait_for(child.run(), 30)
    assert (child.starts, child.final_code, child.gave_up) == (1, 3, True)


async def test_stop_terminates_the_whole_process_group() -> None:
    # The child starts a grandchild in its group; both must be gone after stop().
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(g.pid, flush=True); time.sleep(60)"
    )
    out = io.StringIO()
    child = Supervised(ChildSpec("gateway", python(code)), backoff=fast_backoff(), out=out)
    task = asyncio.create_task(child.run())
    grandchild = await _first_pid(out)
    pid = child.pid
    assert pid is not None
    await asyncio.wait_for(child.stop(grace=10), 30)
    await task
    assert not _alive(pid)
    # The grandchild got the same SIGTERM but is not ours to reap: it may take a moment
    # on a busy machine to die (a failure once in scripts/check); it must not outlive 10 s.
    await until(lambda: not _alive(grandchild), within_s=10)
    assert child.starts == 1 and not child.gave_up


async def test_stop_escalates_to_sigkill_after_the_grace_period() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    out = io.StringIO()
    child = Supervised(ChildSpec("scheduler", python(code)), backoff=fast_backoff(), out=out)
    task = asyncio.create_task(child.run())
    await until(lambda: "ready" in out.getvalue())
    await asyncio.wait_for(child.stop(grace=0.3), 30)
    await task
    assert "still running 0.3 s after SIGTERM; sending SIGKILL" in out.getvalue()
    assert child.pid is not None and not _alive(child.pid)


async def test_stop_during_back_off_does_not_start_again() -> None:
    child = Supervised(
        ChildSpec("agent m r2", python("import sys; sys.exit(1)")),
        backoff=Backoff(initial=30, cap=30),
        out=io.StringIO(),
    )
    task = asyncio.create_task(child.run())
    await until(
        lambda: child.final_code is None and child.pid is not None and not _alive(child.pid)
    )
    await asyncio.wait_for(child.stop(grace=1), 5)
    await task
    assert child.starts == 1


async def until(condition: Callable[[], bool], within_s: float = 30) -> None:
    """Poll a condition about a real process (no event to wait on across processes)."""
    for _ in range(int(within_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def _first_pid(out: io.StringIO) -> int:
    def pid_line() -> str | None:
        texts = [line.split("] ", 1)[-1] for line in out.getvalue().splitlines()]
        return next((t for t in texts if t.isdigit()), None)

    await until(lambda: pid_line() is not None)
    return int(pid_line() or 0)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_alive_helper_sees_this_process() -> None:
    assert _alive(os.getpid())
