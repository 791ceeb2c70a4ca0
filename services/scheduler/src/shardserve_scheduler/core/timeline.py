"""A job's timeline: when each stage was published and when each rank answered."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timeline:
    """Events relative to ``origin`` (when the request was accepted), for debug logs."""

    origin: float
    events: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, now: float, label: str) -> None:
        self.events.append((now, label))

    def render(self, now: float) -> str:
        """e.g. 'queued +0.0 ms, s0 publish +0.1 ms, s0 r1 +3.2 ms, s0 r0 +3.4 ms, end +3.5 ms'."""
        parts = [f"{label} +{(t - self.origin) * 1000:.1f} ms" for t, label in self.events]
        parts.append(f"end +{(now - self.origin) * 1000:.1f} ms")
        return ", ".join(parts)
