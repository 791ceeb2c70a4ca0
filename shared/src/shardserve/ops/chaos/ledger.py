"""The ledger: every request id sent under load, and the one outcome it ended with.

Outcome kinds (Jepsen's total-queue idea, adapted to HTTP):
- ``ok``: 200 with the right answer;
- ``wrong``: 200 with a wrong answer (must never happen);
- ``error``: an HTTP error status with a message; keyed ``<status>:<code>``;
- ``connection``: the connection was refused or dropped (a clear error, never silence);
- ``hung``: no answer by the request's deadline plus a grace period (must be 0).

An id with no outcome when the load stops is *lost*; an id given a second outcome is
*duplicated*. Both must be 0: the ledger proves "exactly one outcome per request".
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

OutcomeKind = Literal["ok", "wrong", "error", "connection", "hung"]

# The gateway answers {"error": message}; the message says why. These words name the
# error code when the body carries none.
_CODE_WORDS: tuple[tuple[str, str], ...] = (
    ("deadline", "deadline_exceeded"),
    ("overloaded", "overloaded"),
    ("rank", "rank_lost"),
    ("shutting down", "shutting_down"),
    ("draining", "shutting_down"),
    ("scheduler", "scheduler_unavailable"),
    ("broker", "broker_unreachable"),
    ("not ready", "not_ready"),
    ("larger than", "payload_too_large"),
)


def error_code(body: object) -> str:
    """A short error code from an error body: its ``code`` field, else its message's words."""
    if isinstance(body, dict):
        code = body.get("code")
        if isinstance(code, str) and code:
            return code
        message = str(body.get("error") or body.get("error_msg") or "")
    else:
        message = str(body or "")
    lowered = message.lower()
    for word, code in _CODE_WORDS:
        if word in lowered:
            return code
    return re.sub(r"[^a-z]+", "_", lowered)[:24].strip("_") or "unknown"


@dataclass
class Outcome:
    kind: OutcomeKind
    detail: str  # "ok", "503:rank_lost", "connection:refused", ...
    sent_at: float
    done_at: float


@dataclass
class Ledger:
    """Request ids in, one outcome each out; counts everything else as a defect."""

    sent: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    duplicated: int = 0
    unexpected: int = 0  # outcomes for ids that were never sent

    def send(self, request_id: str, now: float) -> None:
        self.sent[request_id] = now

    def record(self, request_id: str, kind: OutcomeKind, detail: str, now: float) -> None:
        if request_id not in self.sent:
            self.unexpected += 1
            return
        if request_id in self.outcomes:
            self.duplicated += 1
            return
        self.outcomes[request_id] = Outcome(kind, detail, self.sent[request_id], now)

    @property
    def lost(self) -> int:
        return sum(1 for rid in self.sent if rid not in self.outcomes)

    def count(self, kind: OutcomeKind) -> int:
        return sum(1 for o in self.outcomes.values() if o.kind == kind)

    def errors_by_kind(self) -> dict[str, int]:
        counts = Counter(
            o.detail for o in self.outcomes.values() if o.kind in ("error", "connection")
        )
        return dict(sorted(counts.items()))

    def first_failure_after(self, t: float) -> float | None:
        times = [o.done_at for o in self.outcomes.values() if o.kind != "ok" and o.done_at >= t]
        return min(times, default=None)

    def first_ok_sent_after(self, t: float) -> float | None:
        """When the first request sent at or after ``t`` came back ok."""
        times = [o.done_at for o in self.outcomes.values() if o.kind == "ok" and o.sent_at >= t]
        return min(times, default=None)

    def exactly_one_outcome(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0
