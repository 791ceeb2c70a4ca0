"""The agent registry: which instance serves which rank of which group, and is it alive.

Pure: every method takes ``now`` (seconds, the caller's clock). A group (servable,
version) is ready when every one of its ranks is held by a live instance in state
"ready". A rank is lost when its instance has not been heard of for ``heartbeat_timeout``
seconds; the group heals when the instance (or a new one) comes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from shardserve.repo.repository import GroupConfig
from shardserve.wire.protocol import AgentBye, AgentHeartbeat, AgentHello, RankReport, RankStatus

GroupKey = tuple[str, int]
RankState = Literal["missing", "loading", "ready", "draining", "lost"]
_LIVE: frozenset[str] = frozenset({"loading", "ready", "draining"})
# The one refusal that waiting can cure (the holder may time out): it carries retry_after_s.
_HELD_PREFIX = "rank {rank} of {group} is already served by instance"


@dataclass
class RankSlot:
    """What the registry knows about one rank of a group."""

    rank: int
    stage: int
    expected_checksum: str
    state: RankState = "missing"
    instance: str = ""
    last_seen: float | None = None
    slice_checksum: str = ""
    cache: str = "off"
    control_key: str = ""
    kv_bytes_per_token: int = 0  # generation servables: the KV cache cost of one token
    report: RankReport = field(default_factory=RankReport)  # the agent's latest figures

    @property
    def live(self) -> bool:
        return self.state in _LIVE

    @property
    def kv_capacity_bytes(self) -> int:
        return self.report.kv_capacity_bytes

    def take(self, msg: AgentHello | AgentHeartbeat, now: float) -> None:
        """Record the state an agent reports (hello or heartbeat)."""
        self.state = msg.state
        self.instance = msg.instance
        self.last_seen = now
        self.slice_checksum = msg.slice_checksum
        self.cache = msg.cache
        self.control_key = msg.control_key
        self.kv_bytes_per_token = msg.kv_bytes_per_token
        self.report = msg  # the message is the report (and immutable)

    def status(self, now: float) -> RankStatus:
        age = None if self.last_seen is None else round(max(0.0, now - self.last_seen), 3)
        figures = {name: getattr(self.report, name) for name in RankReport.model_fields}
        return RankStatus(
            rank=self.rank,
            stage=self.stage,
            state=self.state,
            heartbeat_age_s=age,
            slice_checksum=self.slice_checksum,
            cache=self.cache,
            **figures,
        )


@dataclass
class GroupState:
    config: GroupConfig
    slots: list[RankSlot]
    wait_failure: str = ""
    was_complete: bool = False

    @property
    def name(self) -> str:
        return f"{self.config.servable} v{self.config.version}"

    @property
    def ready(self) -> bool:
        return all(slot.state == "ready" for slot in self.slots)

    def not_ready_reason(self) -> str:
        """'' when ready, else e.g. 'matmul v1 is not ready: ranks 3, 5 missing; rank 2 lost'."""
        by_state: dict[str, list[int]] = {}
        for slot in self.slots:
            if slot.state != "ready":
                by_state.setdefault(slot.state, []).append(slot.rank)
        if not by_state:
            return ""
        parts = [f"{_ranks_phrase(ranks)} {state}" for state, ranks in sorted(by_state.items())]
        reason = f"{self.name} is not ready: {'; '.join(parts)}"
        return f"{reason} ({self.wait_failure})" if self.wait_failure else reason

    def agents_count(self) -> int:
        return sum(1 for slot in self.slots if slot.live)


def _ranks_phrase(ranks: list[int]) -> str:
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(str(r) for r in ranks)}"


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class RankLoss:
    """Ranks of a group that just stopped serving (timeout or bye)."""

    servable: str
    version: int
    ranks: tuple[int, ...]
    why: str

    @property
    def message(self) -> str:
        ranks = _ranks_phrase(list(self.ranks))
        return f"{self.servable} v{self.version} lost {ranks} ({self.why})"


@dataclass
class Registry:
    groups: dict[GroupKey, GroupState]
    heartbeat_timeout: float = 3.0
    wait_agents_seconds: float = 0.0
    started_at: float = 0.0
    ignored_heartbeats: int = field(default=0)

    @classmethod
    def build(
        cls,
        configs: Iterable[GroupConfig],
        now: float,
        *,
        heartbeat_timeout: float = 3.0,
        wait_agents_seconds: float = 0.0,
    ) -> Registry:
        groups = {
            (c.servable, c.version): GroupState(
                c, [RankSlot(r.rank, r.stage, r.checksum) for r in c.ranks]
            )
            for c in configs
        }
        return cls(groups, heartbeat_timeout, wait_agents_seconds, now)

    def add_group(self, config: GroupConfig) -> None:
        """A version loaded while running: its ranks start missing (agents register later)."""
        key = (config.servable, config.version)
        if key not in self.groups:
            slots = [RankSlot(r.rank, r.stage, r.checksum) for r in config.ranks]
            self.groups[key] = GroupState(config, slots)

    def remove_group(self, servable: str, version: int) -> list[str]:
        """Forget an unloaded version; return the instances that still held its ranks."""
        group = self.groups.pop((servable, version), None)
        if group is None:
            return []
        return [slot.instance for slot in group.slots if slot.instance and slot.live]

    def group(self, servable: str, version: int) -> GroupState | None:
        return self.groups.get((servable, version))

    def hello(self, msg: AgentHello, now: float) -> Verdict:
        """Admit an agent to its rank, or refuse it saying why."""
        group = self.groups.get((msg.servable, msg.version))
        if group is None:
            return Verdict(False, self._unknown_group(msg.servable, msg.version))
        refusal = _refusal(group, msg)
        if refusal:
            held = refusal.startswith(_HELD_PREFIX.format(rank=msg.rank, group=group.name))
            return Verdict(False, refusal, self._retry_after(group, msg, now) if held else 0.0)
        slot = group.slots[msg.rank]
        slot.take(msg, now)
        # Accepted agents declare their work queues only now; the rank serves from its
        # first heartbeat after this verdict, so no StageWork can reach a missing queue.
        if slot.state == "ready":
            slot.state = "loading"
        return Verdict(True)

    def _retry_after(self, group: GroupState, msg: AgentHello, now: float) -> float:
        """For a rank held by another instance: seconds until that holder would time out."""
        if not 0 <= msg.rank < len(group.slots):
            return 0.0
        slot = group.slots[msg.rank]
        if not slot.live or slot.instance == msg.instance or slot.last_seen is None:
            return 0.0
        return round(max(0.0, self.heartbeat_timeout - (now - slot.last_seen)) + 0.5, 3)

    def _unknown_group(self, servable: str, version: int) -> str:
        versions = sorted(v for s, v in self.groups if s == servable)
        if not versions:
            known = ", ".join(sorted({s for s, _ in self.groups})) or "none"
            return f"unknown servable {servable!r} (servables: {known})"
        listed = ", ".join(str(v) for v in versions)
        return f"unknown version {version} of servable {servable!r} (versions: {listed})"

    def heartbeat(self, msg: AgentHeartbeat, now: float) -> bool:
        """Refresh the rank held by this instance; False (ignored) if it holds none."""
        slot = self._slot_of(msg.servable, msg.version, msg.rank, msg.instance)
        if slot is None:
            self.ignored_heartbeats += 1
            return False
        slot.take(msg, now)
        group = self.groups[(msg.servable, msg.version)]
        group.was_complete = group.was_complete or group.ready
        return True

    def bye(self, msg: AgentBye) -> RankLoss | None:
        """An agent leaves on purpose: its rank becomes missing."""
        slot = self._slot_of(msg.servable, msg.version, msg.rank, msg.instance)
        if slot is None:
            return None
        was_live = slot.live
        slot.state = "missing"
        slot.instance = ""
        if not was_live:
            return None
        return RankLoss(msg.servable, msg.version, (msg.rank,), f"instance {msg.instance} left")

    def _slot_of(self, servable: str, version: int, rank: int, instance: str) -> RankSlot | None:
        group = self.groups.get((servable, version))
        if group is None or not 0 <= rank < len(group.slots):
            return None
        slot = group.slots[rank]
        return slot if slot.instance == instance and slot.state != "missing" else None

    def tick(self, now: float) -> list[RankLoss]:
        """Mark ranks lost whose heartbeat is older than the timeout; return the losses."""
        losses: list[RankLoss] = []
        for group in self.groups.values():
            lost = [s.rank for s in group.slots if s.live and self._expired(s, now)]
            for rank in lost:
                group.slots[rank].state = "lost"
            if lost:
                why = f"no heartbeat for {self.heartbeat_timeout:g} s"
                losses.append(
                    RankLoss(group.config.servable, group.config.version, tuple(lost), why)
                )
        return losses

    def _expired(self, slot: RankSlot, now: float) -> bool:
        return slot.last_seen is None or now - slot.last_seen > self.heartbeat_timeout

    def expired_waits(self, now: float) -> list[str]:
        """Groups still incomplete ``wait_agents_seconds`` after start (reported once each)."""
        if self.wait_agents_seconds <= 0 or now - self.started_at < self.wait_agents_seconds:
            return []
        failures: list[str] = []
        for group in self.groups.values():
            if group.wait_failure or group.was_complete or group.ready:
                continue
            group.wait_failure = (
                f"Failed to wait for ready of all agents of {group.name}, current agents count: "
                f"{group.agents_count()}, rank size: {group.config.rank_size}"
            )
            failures.append(group.wait_failure)
        return failures

    def readiness(self) -> dict[GroupKey, bool]:
        return {key: group.ready for key, group in self.groups.items()}


def _refusal(group: GroupState, msg: AgentHello) -> str:
    config = group.config
    if not 0 <= msg.rank < config.rank_size:
        return f"rank {msg.rank} is outside group {group.name} (rank_size {config.rank_size})"
    slot = group.slots[msg.rank]
    if msg.stage != slot.stage:
        return f"rank {msg.rank} of {group.name} is in stage {slot.stage}, agent says {msg.stage}"
    if msg.slice_checksum != slot.expected_checksum:
        return (
            f"slice checksum mismatch for rank {msg.rank} of {group.name}: agent has "
            f"{msg.slice_checksum[:12]}..., group.json says {slot.expected_checksum[:12]}..."
        )
    if slot.live and slot.instance != msg.instance:
        return _HELD_PREFIX.format(rank=msg.rank, group=group.name) + (
            f" {slot.instance} (host {slot.report.host or '?'}, pid {slot.report.pid})"
        )
    return ""
