"""What one fuzz source sent and what came back, in counts a report can print."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

EXAMPLES_KEPT = 10  # a few failing requests are enough to reproduce; all are counted


@dataclass
class HttpTally:
    """Requests of one source (a spec) by status; 0 = no answer (timeout, closed)."""

    source: str
    statuses: Counter[int] = field(default_factory=Counter)
    refused_by_client: int = 0  # requests the HTTP client would not send (bad header bytes)
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0  # the longest wait for an answer (of those timed)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def no_answer(self) -> int:
        return self.statuses[0]

    @property
    def passed(self) -> bool:
        return self.sent > 0 and self.server_errors == 0 and self.no_answer == 0

    def record(self, status: int, what: str, seconds: float = 0.0) -> None:
        self.statuses[status] += 1
        self.slowest_s = max(self.slowest_s, seconds)
        if (status >= 500 or status == 0) and len(self.failures) < EXAMPLES_KEPT:
            self.failures.append(f"{status}: {what}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sent": self.sent,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "server_errors": self.server_errors,
            "no_answer": self.no_answer,
            "refused_by_client": self.refused_by_client,
            "slowest_s": round(self.slowest_s, 3),
            "failures": self.failures,
            "passed": self.passed,
        }

    def summary(self) -> str:
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(self.statuses.items()))
        return (
            f"http {self.source}: sent {self.sent} (client refused {self.refused_by_client}); "
            f"statuses {statuses}; 5xx {self.server_errors}; no answer {self.no_answer}; "
            f"slowest answer {self.slowest_s:.1f} s"
        )
