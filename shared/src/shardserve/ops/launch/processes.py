"""The supervised processes of one ``shardserve up``: the scheduler(s) and the gateway,
and the agents of each servable version, which come and go while the mesh runs.

Every child's ``run`` is a task of the one TaskGroup ``serve`` owns (``attach``); so are
the tasks that retire a version's agents. ``stop`` stops the tiers in ``STOP_ORDER``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from shardserve.ops.launch.plan import STOP_ORDER, GroupKey
from shardserve.process.supervise import EXIT_REFUSED, ChildSpec, Supervised
from shardserve.repo.repository import GroupConfig


class Mesh:
    """Started tier by tier; agents are grouped by the version they serve."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.core: dict[str, list[Supervised]] = {"scheduler": [], "gateway": []}
        self.groups: dict[GroupKey, tuple[GroupConfig, list[Supervised]]] = {}
        self.agents: list[Supervised] = []  # every agent ever started, for stop and kill
        self.stop_requested = asyncio.Event()
        self.failed = False
        self._tasks: asyncio.TaskGroup | None = None

    # ------------------------------------------------------------ start

    def attach(self, tasks: asyncio.TaskGroup) -> None:
        """The TaskGroup that owns every child's task from now on."""
        self._tasks = tasks

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        assert self._tasks is not None, "attach() first"
        self._tasks.create_task(coroutine)

    def start_core(self, tier: str, spec: ChildSpec) -> None:
        child = Supervised(spec, env=self.env)
        self.core[tier].append(child)
        self.spawn(self._watch_core(child))

    def start_group(self, group: GroupConfig, specs: list[ChildSpec]) -> None:
        """Start (or start again) the agents of one version."""
        children = [Supervised(spec, env=self.env) for spec in specs]
        self.groups[(group.servable, group.version)] = (group, children)
        self.agents.extend(children)
        for child in children:
            self.spawn(child.run())

    async def _watch_core(self, child: Supervised) -> None:
        """Scheduler and gateway: if one gives up (usage error), the whole mesh stops."""
        await child.run()
        if child.gave_up:
            print(f"{child.spec.label} cannot run; stopping", file=sys.stderr, flush=True)
            self.failed = True
            self.stop_requested.set()

    # ------------------------------------------------------------ versions

    def running_groups(self) -> list[GroupConfig]:
        """The versions whose agents run (the ones readiness is expected of)."""
        return [group for group, _ in self.groups.values()]

    def released(self, key: GroupKey) -> bool:
        """True when every agent of the version left because the scheduler refused it
        (exit 3: the version was unloaded, or its ranks are not the scheduler's)."""
        _, children = self.groups[key]
        return all(child.final_code == EXIT_REFUSED for child in children)

    def forget(self, key: GroupKey) -> None:
        """Drop a version whose agents have all left."""
        self.groups.pop(key, None)

    def retire(self, key: GroupKey, patience: float, grace: float) -> None:
        """No more restarts for the version's agents; they leave when the scheduler has
        drained the version and tells them to (exit 3). Those still running after
        ``patience`` seconds get SIGTERM (then SIGKILL after ``grace``)."""
        _, children = self.groups.pop(key)
        for child in children:
            child.retire()
        self.spawn(_stop_stragglers(children, patience, grace))

    # ------------------------------------------------------------ stop

    def on_signal(self) -> None:
        if self.stop_requested.is_set():
            print("second signal: killing every process now", file=sys.stderr, flush=True)
            self.kill_all()
        self.stop_requested.set()

    def kill_all(self) -> None:
        for child in self.children:
            child.kill_now()

    @property
    def children(self) -> list[Supervised]:
        return [*self.core["scheduler"], *self.core["gateway"], *self.agents]

    def tier(self, name: str) -> list[Supervised]:
        return self.agents if name == "agent" else self.core[name]

    async def stop(self, grace: float) -> None:
        print("stopping: gateway, then scheduler, then agents", file=sys.stderr, flush=True)
        for name in STOP_ORDER:
            await asyncio.gather(*(child.stop(grace) for child in self.tier(name)))
        print("stopped", file=sys.stderr, flush=True)


async def _stop_stragglers(children: list[Supervised], patience: float, grace: float) -> None:
    waits = await asyncio.gather(*(child.wait_done(patience) for child in children))
    stragglers = [child for child, done in zip(children, waits, strict=True) if not done]
    await asyncio.gather(*(child.stop(grace) for child in stragglers))
