"""Several rounds of the same scenarios, summarized by their medians.

One round on this kind of machine moves by 15-30 % from the next (the floor's JSON c32 has
read 504 and 733 req/s a minute apart). ``python -m benchmarks --rounds N`` runs the
scenarios N times in a row and reports:

- per ratio, the median of the N per-round ratios (each computed from one round's own
  measurements, so still "measured in the same run"), with every round's value beside it;
  for an even N the lower of the two middle ones, so the figure (and its detail, such as
  the per-hop milliseconds) is one round's;
- per measurement, the round that gave the median requests/s (its p50, p99 and CPU
  figures come along unchanged, so a row is always one real measurement, never a blend).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from benchmarks.ratios import Ratio, fmt
from benchmarks.report import compute_ratios


def median_entry(entries: list[Any]) -> Any:
    """The entry of the median round: by ``rps`` for a load, by ``ratio`` for a reference
    (``*.ceiling``); anything else is taken from the first round that has it."""
    for field in ("rps", "ratio"):
        ranked = [e for e in entries if isinstance(e, dict) and _number(e.get(field))]
        if ranked and len(ranked) == len(entries):
            ranked.sort(key=lambda e: float(e[field]))
            return ranked[(len(ranked) - 1) // 2]  # the lower median: a real round
    return entries[0]


def combine_results(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict: for every key, the median round's entry (key order of first seen)."""
    keys = list(dict.fromkeys(key for results in rounds for key in results))
    return {key: median_entry([r[key] for r in rounds if key in r]) for key in keys}


def combine_ratios(rounds: list[dict[str, Any]]) -> list[Ratio]:
    """Each ratio's median over the rounds that measured it, every round's value named."""
    per_round = [compute_ratios(results) for results in rounds]
    if len(per_round) == 1:
        return per_round[0]
    combined: list[Ratio] = []
    for column in zip(*per_round, strict=True):
        measured = sorted((r for r in column if r.value is not None), key=lambda r: r.value or 0)
        if not measured:
            combined.append(column[0])
            continue
        median = measured[(len(measured) - 1) // 2]
        listed = ", ".join(fmt(r.value) for r in column)
        combined.append(replace(median, detail=f"{median.detail}; rounds: {listed}"))
    return combined


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
