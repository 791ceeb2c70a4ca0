"""Instances waiting for a Python step, and the Python tasks running for them.

A Python step becomes a ``RunPython`` action (the shell runs it in a worker pool); a
batched Python step (batch_size 0 or k) gets a list of the instances waiting for it after
the current event, at most k (0: the maximum batch size) per call.
"""

from __future__ import annotations

from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core.actions import Action, RunPython
from shardserve_scheduler.core.jobs import LaneKey, RequestState
from shardserve_scheduler.core.methods import PythonStep
from shardserve_scheduler.core.open_requests import Ids, OpenRequests
from shardserve_scheduler.core.pystages import PythonTask
from shardserve_scheduler.core.request_limits import RequestLimits

PyKey = tuple[LaneKey, str, int]  # (servable version, method, step position)
PyMembers = list[tuple[str, int]]  # (request key, instance index) of each instance


class PythonQueue:
    """Who waits for which Python step, and which instances each running task serves."""

    def __init__(self, limits: RequestLimits, ids: Ids, requests: OpenRequests) -> None:
        self._limits = limits
        self._ids = ids
        self._requests = requests
        self._waiting: dict[PyKey, tuple[PythonStep, PyMembers]] = {}
        self._running: dict[str, tuple[PyKey, PyMembers]] = {}

    def wait(self, state: RequestState, index: int, step: PythonStep) -> None:
        """The instance waits for ``step`` (its current one) until the event's end."""
        instance = state.instances[index]
        key: PyKey = (state.call.lane_key, state.call.method.name, instance.step)
        self._waiting.setdefault(key, (step, []))[1].append((state.key, index))
        instance.where = f"Python stage {step.index} ({step.tag})"

    def start(self) -> list[Action]:
        """One task per instance waiting (per batch of them, for a batched step)."""
        actions: list[Action] = []
        waiting, self._waiting = self._waiting, {}
        for key, (step, members) in waiting.items():
            live = [(k, i) for k, i in members if self._requests.alive(k, i, key[2])]
            limit = self._limits.max_batch_size
            size = 1 if step.batch_size is None else (step.batch_size or limit)
            for start in range(0, len(live), size):
                chunk = live[start : start + size]
                task_id = self._ids.new("p")
                self._running[task_id] = (key, chunk)
                args = tuple(self._args(step, k, i) for k, i in chunk)
                actions.append(RunPython(PythonTask(task_id, key[1], step, args)))
        return actions

    def finish(self, task_id: str) -> tuple[int, PyMembers] | None:
        """The step position and the instances of a task that ended, or None if unknown."""
        entry = self._running.pop(task_id, None)
        if entry is None:
            return None
        (_, _, position), members = entry
        return position, members

    def _args(self, step: PythonStep, key: str, index: int) -> tuple[Tensor, ...]:
        state = self._requests.get(key)
        if state is None:
            raise KeyError(f"a Python task for request {key}, which is not open")
        env = state.instances[index].env
        return tuple(env[ref] for ref in step.inputs)
