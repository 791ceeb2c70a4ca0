"""The readiness log announces each group's change of readiness once, with a manual clock."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.readiness import ReadinessLog


def test_each_change_is_logged_and_broadcast_once(
    kit: Any, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry.build([kit.group(rank_size=2)], 0.0, heartbeat_timeout=3.0)
    asked: list[str] = []
    log = ReadinessLog(registry, changed=lambda: asked.append("status"))
    caplog.set_level(logging.INFO, logger="shardserve_scheduler.readiness")
    kit.join(registry, 0, 1.0)
    log.check()  # one rank of two: still unready, nothing to say
    assert asked == [] and caplog.messages == []
    kit.join(registry, 1, 1.0)
    log.check()
    log.check()
    assert asked == ["status"] and caplog.messages == ["matmul v1 is ready"]
    registry.tick(10.0)  # both ranks silent past the heartbeat timeout
    log.check()
    assert asked == ["status", "status"]
    assert caplog.messages[-1] == "matmul v1 is not ready: ranks 0, 1 lost"


def test_accepted_readiness_is_not_announced(kit: Any) -> None:
    registry = Registry.build([kit.group(rank_size=1)], 0.0)
    asked: list[str] = []
    log = ReadinessLog(registry, changed=lambda: asked.append("status"))
    kit.join(registry, 0, 1.0)
    assert registry.groups[("matmul", 1)].ready
    log.accept()
    log.check()
    assert asked == []
