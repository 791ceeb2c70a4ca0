"""Per-scenario figures, their pass/fail verdict, and how they are printed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardserve.ops.chaos.ledger import Ledger


@dataclass
class ScenarioReport:
    name: str
    sent: int = 0
    succeeded: int = 0
    wrong: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # "<status>:<code>" -> count
    hung: int = 0
    lost: int = 0
    duplicated: int = 0
    unexpected: int = 0
    detect_s: float | None = None
    recover_s: float | None = None
    recovered: bool = True
    skipped: str | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_ledger(cls, name: str, ledger: Ledger) -> ScenarioReport:
        return cls(
            name=name,
            sent=len(ledger.sent),
            succeeded=ledger.count("ok"),
            wrong=ledger.count("wrong"),
            failed=ledger.errors_by_kind(),
            hung=ledger.count("hung"),
            lost=ledger.lost,
            duplicated=ledger.duplicated,
            unexpected=ledger.unexpected,
        )

    @property
    def exactly_one_outcome(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0

    @property
    def passed(self) -> bool:
        if self.skipped:
            return True
        clean = self.hung == 0 and self.wrong == 0 and self.exactly_one_outcome
        return clean and self.recovered and not self.problems

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["failed_total"] = sum(self.failed.values())
        return data


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def format_report(report: ScenarioReport) -> str:
    if report.skipped:
        return f"{report.name}: SKIPPED ({report.skipped})"
    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"{report.name}: {verdict}",
        f"  sent {report.sent}  succeeded {report.succeeded}  failed "
        f"{sum(report.failed.values())}  hung {report.hung}  lost {report.lost}  "
        f"duplicated {report.duplicated}  wrong {report.wrong}",
        f"  time to detect {_seconds(report.detect_s)}  time to recover "
        f"{_seconds(report.recover_s)}" + ("" if report.recovered else "  (NOT RECOVERED)"),
    ]
    for kind, count in report.failed.items():
        lines.append(f"    {kind:<40} {count}")
    lines += [f"  note: {n}" for n in report.notes]
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    return "\n".join(lines)
