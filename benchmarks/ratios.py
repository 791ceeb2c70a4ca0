"""A target ratio and how figures are printed: what every report module shares (report,
gen_report, gen_bar_report import it from here, so none imports another for it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Ratio:
    name: str
    value: float | None
    target: str  # e.g. ">= 0.8"
    detail: str

    @property
    def passed(self) -> bool | None:
        if self.value is None or math.isnan(self.value) or self.target == "-":
            return None  # not measured, or a figure shown for comparison only
        op, bound = self.target.split()
        return self.value >= float(bound) if op == ">=" else self.value <= float(bound)


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}g}"
