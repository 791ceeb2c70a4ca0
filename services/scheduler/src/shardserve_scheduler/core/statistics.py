"""Per servable version: requests seen, errors, batches formed (for status and metrics),
kept until the version is forgotten."""

from __future__ import annotations

from dataclasses import replace

from shardserve_scheduler.core.jobs import LaneKey, VersionStats


class Statistics:
    def __init__(self) -> None:
        self._by_version: dict[LaneKey, VersionStats] = {}

    def of(self, key: LaneKey) -> VersionStats:
        """A copy of the version's statistics (zeros for one never seen)."""
        return replace(self._by_version.get(key, VersionStats()))

    def request(self, key: LaneKey) -> None:
        self._entry(key).requests_total += 1

    def error(self, key: LaneKey) -> None:
        self._entry(key).errors_total += 1

    def batch(self, key: LaneKey, members: int) -> None:
        entry = self._entry(key)
        entry.batches_total += 1
        entry.batched_instances_total += members

    def forget(self, key: LaneKey) -> None:
        self._by_version.pop(key, None)

    def _entry(self, key: LaneKey) -> VersionStats:
        return self._by_version.setdefault(key, VersionStats())
