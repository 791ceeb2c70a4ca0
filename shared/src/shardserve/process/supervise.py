"""Keep child processes running: spawn, prefix their output, restart with back-off, stop.

Each child runs in its own process group (a new session), so a terminal's Ctrl-C reaches
only the launcher, which then stops the children in the order it chooses; signals go to
the whole group so nothing a child started is left behind.

A child that dies unexpectedly is restarted after 1 s, 2 s, 4 s ... (capped at 30 s); a
child that stayed up for 60 s counts as healthy again and the next restart waits 1 s.
Exit codes listed in ``final_codes`` are decisions, not crashes (2: usage error; 3: agent
registration refused) and are not restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from shardserve.process.waits import set_within

EXIT_USAGE = 2
EXIT_REFUSED = 3


@dataclass(frozen=True)
class ChildSpec:
    """One supervised command line and how to label its output."""

    label: str
    argv: tuple[str, ...]
    final_codes: frozenset[int] = field(default_factory=lambda: frozenset({EXIT_USAGE}))
    # A floor under the back-off, for children that must not come back too early.
    min_restart_delay: float = 0.0


class Backoff:
    """Restart delays: doubling from ``initial`` up to ``cap``; reset after a healthy run."""

    def __init__(self, initial: float = 1.0, cap: float = 30.0, healthy_after: float = 60.0):
        self.initial = initial
        self.cap = cap
        self.healthy_after = healthy_after
        self._next = initial

    def delay_after(self, uptime: float) -> float:
        """The wait before the next start, given how long the last run lasted."""
        if uptime >= self.healthy_after:
            self._next = self.initial
        delay = self._next
        self._next = min(self.cap, delay * 2)
        return delay


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervised:
    """One child kept running until ``stop``; ``run`` is its one owning task."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        env: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._env = dict(os.environ if env is None else env)
        self._backoff = backoff or Backoff()
        self._out = out or sys.stderr
        self._clock = clock
        self._stopping = asyncio.Event()
        self._done = asyncio.Event()
        self._process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.final_code: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def gave_up(self) -> bool:
        """True when the child ended with a final code and will not be restarted."""
        return self.final_code is not None and not self._stopping.is_set()

    def say(self, text: str) -> None:
        self._out.write(f"[{self.spec.label}] {text}\n")
        self._out.flush()

    async def run(self) -> None:
        """Start, watch and restart the child until ``stop`` or a final exit code."""
        try:
            await self._supervise()
        finally:
            self._done.set()

    async def _supervise(self) -> None:
        while not self._stopping.is_set():
            started = self._clock()
            code = await self._run_once()
            if self._stopping.is_set():
                return
            if code in self.spec.final_codes:
                self.final_code = code
                self.say(f"{describe_exit(code)}; not restarting")
                return
            delay = max(
                self._backoff.delay_after(self._clock() - started), self.spec.min_restart_delay
            )
            self.say(f"{describe_exit(code)}; restarting in {delay:g} s")
            await set_within(self._stopping, delay)

    async def _run_once(self) -> int:
        try:
            process = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )
        except OSError as exc:
            self.say(f"cannot start {self.spec.argv[0]}: {exc}")
            return 127
        self._process = process
        self.starts += 1
        if self._stopping.is_set():  # stop() ran while we were spawning
            self._signal(signal.SIGTERM)
        assert process.stdout is not None
        async for line in process.stdout:
            self._out.write(f"[{self.spec.label}] {line.decode(errors='replace').rstrip()}\n")
            self._out.flush()
        return await process.wait()

    def _signal(self, sig: signal.Signals) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    async def stop(self, grace: float) -> None:
        """SIGTERM the child's group, wait up to ``grace`` s, then SIGKILL it; no restart."""
        self._stopping.set()
        self._signal(signal.SIGTERM)
        if await set_within(self._done, grace):
            return
        self.say(f"still running {grace:g} s after SIGTERM; sending SIGKILL")
        self._signal(signal.SIGKILL)
        await self._done.wait()

    def retire(self) -> None:
        """Let the child end on its own (e.g. when told to leave); it is not restarted."""
        self._stopping.set()

    async def wait_done(self, within: float) -> bool:
        """Wait up to ``within`` s for ``run`` to end; True if it did."""
        return await set_within(self._done, within)

    def kill_now(self) -> None:
        """Last resort (second Ctrl-C, or the launcher failing): SIGKILL without waiting."""
        self._stopping.set()
        self._signal(signal.SIGKILL)
