"""Waiting for a state instead of sleeping for it: poll a probe until it finds what it looks
for, or fail naming what never came (generous deadlines: CI runs on a loaded machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], within_s: float = 60.0) -> T:
    """The first value ``probe`` returns that is not None; AssertionError after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s:.0f} s")
        time.sleep(0.1)  # the poll interval of the probe, not a wait for the state
    return found


def beaten_since(status: dict[str, Any], servable: str, since: float) -> bool:
    """Whether, in a mesh status (``/api/status``), every rank of ``servable`` has a heartbeat
    the scheduler received after its clock read ``since``: counters newer than that moment."""
    (entry,) = [s for s in status["servables"] if s["name"] == servable]
    ages = [rank["heartbeat_age_s"] for rank in entry["ranks"]]
    return all(age is not None and status["time"] - age > since for age in ages)
