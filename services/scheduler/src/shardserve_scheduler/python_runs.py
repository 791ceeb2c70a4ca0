"""Python stages, run in a thread pool (--python-workers), each a task of the service's
TaskGroup that feeds its outcome back to the request machine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from shardserve_scheduler.core.actions import RunPython
from shardserve_scheduler.core.pystages import run_python_task
from shardserve_scheduler.machines import Machines


class PythonRuns:
    """Owns the pool and the runs in flight; takes runs while bound to a TaskGroup."""

    def __init__(self, workers: int, machines: Machines) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pystage")
        self._machines = machines
        self._tasks: asyncio.TaskGroup | None = None
        self._runs: set[asyncio.Task[None]] = set()
        self.closing = False  # the drain answered every request: runs would come too late

    def bind(self, tasks: asyncio.TaskGroup | None) -> None:
        """The TaskGroup that owns the runs (None: the service stopped)."""
        self._tasks = tasks

    def start(self, action: RunPython) -> None:
        if self._tasks is None or self.closing:
            return  # stopping: the machine has already answered every request
        run = self._tasks.create_task(self._run(action), name=f"py-{action.task.id}")
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)

    def cancel(self) -> None:
        for run in list(self._runs):
            run.cancel()

    def shutdown(self) -> None:
        """Let the pool's threads go; work not yet started is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, action: RunPython) -> None:
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._pool, run_python_task, action.task)
        self._machines.on_python_done(action.task.id, outcomes)
