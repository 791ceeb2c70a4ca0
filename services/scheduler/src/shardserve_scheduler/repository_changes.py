"""Versions that come and go while the scheduler runs: rescans, load and unload commands.

A rescan (every --repository-poll-seconds, and on a RepositoryCommand "load") adds new
version folders to the catalog and the registry (their agents register when started). A
RepositoryCommand "unload" (or a version folder removed from disk) puts the version in
state "unloading": explicit requests for it get 503, version 0 skips it; once its open
requests are done it is dropped (then 404), and every agent still holding one of its
ranks gets ``RegistrationVerdict(accepted=False, reason="unloaded")``, so it exits
(code 3). A text-generation version drains the same way: it is dropped once it has no
open sequence (waiting or running) and no step in flight; then the generation machine and
the tokenizer cache forget it too, so a later "load" of the same version starts afresh
(a re-exported tokenizer is read again). An unloaded version comes back only with a
"load" command (a scan does not re-add it).

Active and standby schedulers both receive every command (each has its own control
queue) and both apply it to their own catalog, so a standby that takes over serves the
same versions. That is idempotent: a rescan of the same folders changes nothing twice,
and an unload drains only the scheduler's own open requests (a standby has none). Only
the active scheduler talks to agents: the verdicts of a standby are dropped by the
sender.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from shardserve.repo.repository import GroupConfig
from shardserve.wire.protocol import RegistrationVerdict, RepositoryCommand
from shardserve_scheduler.core import rescan
from shardserve_scheduler.core.catalog import Catalog, GroupKey
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.generation.texts import TextModels
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine

_logger = logging.getLogger(__name__)

UNLOADED_REASON = "unloaded"


class RepositoryChanges:
    """Applies rescans and commands to the catalog, registry and request machine."""

    def __init__(
        self,
        repository: Path,
        catalog: Catalog,
        registry: Registry,
        machine: RequestMachine,
        *,
        changed: Callable[[], None],
        send_verdict: Callable[[RegistrationVerdict], None],
        generation: GenerationMachine | None = None,
        texts: TextModels | None = None,
    ) -> None:
        self._repository = repository
        self._catalog = catalog
        self._registry = registry
        self._machine = machine
        self._changed = changed
        self._send_verdict = send_verdict
        self._generation = generation
        self._texts = texts
        self._held_back: set[GroupKey] = set()  # unloaded by command: scans do not re-add

    async def poll(self, interval: float) -> None:
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.rescan()
            except Exception as exc:  # a scan must never take the scheduler down
                _logger.exception("repository rescan failed: %s", exc)

    async def rescan(self) -> None:
        catalog = self._catalog
        result = await asyncio.to_thread(
            rescan.scan,
            self._repository,
            rescan.served_keys(catalog),
            rescan.broken_keys(catalog),
            set(self._held_back),
        )
        for config in rescan.apply(catalog, result):
            self._registry.add_group(config)
            _logger.info(
                "loaded %s v%d (rank_size %d, stage_size %d); waiting for its agents",
                config.servable,
                config.version,
                config.rank_size,
                config.stage_size,
            )
            self._changed()
        for key in result.removed:
            if key not in catalog.unloading:
                _logger.info("%s v%d: its folder is gone; unloading it", *key)
                self.start_unload(key)

    async def on_command(self, command: RepositoryCommand) -> None:
        _logger.info(
            "repository command %s %s v%d", command.action, command.servable, command.version
        )
        if command.action == "load":
            self._held_back = {
                k
                for k in self._held_back
                if k[0] != command.servable or command.version not in (0, k[1])
            }
            await self.rescan()
            return
        for key in sorted(self._command_keys(command)):
            self._held_back.add(key)
            self.start_unload(key)

    def _command_keys(self, command: RepositoryCommand) -> set[GroupKey]:
        if command.version:
            return {(command.servable, command.version)}
        servable = self._catalog.servables.get(command.servable)
        return {(command.servable, v) for v in (servable.all_versions() if servable else [])}

    def start_unload(self, key: GroupKey) -> None:
        if self._catalog.entry(key) is None:
            self._catalog.drop(key)  # a broken or unknown version: nothing to drain
            return
        self._catalog.unloading.add(key)
        _logger.info("%s v%d is unloading: %d request(s) to finish", *key, self._open_for(key))
        self._changed()

    def finish_unloads(self) -> bool:
        """Drop every unloading version with no open request; True if any was dropped."""
        dropped = False
        for key in sorted(self._catalog.unloading):
            if self._open_for(key):
                continue
            instances = self._registry.remove_group(*key)
            self._catalog.drop(key)
            self._forget(key)
            _logger.info("%s v%d unloaded; telling %d agent(s) to leave", *key, len(instances))
            for instance in instances:
                verdict = RegistrationVerdict(
                    instance=instance, accepted=False, reason=UNLOADED_REASON
                )
                self._send_verdict(verdict)
            self._changed()
            dropped = True
        return dropped

    def _open_for(self, key: GroupKey) -> int:
        """Requests and sequences of a version still open, and its steps in flight."""
        count = self._machine.open_for(*key)
        if self._generation is not None:
            state = self._generation.state
            count += sum(1 for s in state.sequences.values() if s.key == key)
            count += sum(1 for t in state.steps.values() if _group_key(t.group) == key)
        return count

    def _forget(self, key: GroupKey) -> None:
        self._machine.forget(*key)
        if self._generation is not None:
            self._generation.forget(*key)
        if self._texts is not None:
            self._texts.forget(*key)


def _group_key(group: GroupConfig) -> GroupKey:
    return (group.servable, group.version)
