"""The scheduler shell answers a request whose admission raised (a bug) at once, alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import InferRequest
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core.actions import Reply
from shardserve_scheduler.service import SchedulerService
from shardserve_scheduler.settings import parse_settings


def test_a_bug_admitting_a_request_answers_it_with_an_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = SchedulerService(parse_settings(["--repository", str(tmp_path)]))
    try:

        def broken(*_: Any) -> Any:
            raise KeyError("boom")

        monkeypatch.setattr(service.intake, "resolve_and_admit", broken)
        request = InferRequest(
            id="r-1",
            servable="matmul",
            instances=({"x": Tensor.from_numpy(np.ones((1, 3), np.float32))},),
            deadline=time.time() + 30,
        )
        (reply,) = service.intake.admit_or_fail(request, "reply.q", "c-1")
    finally:
        service.python_runs.shutdown()
    assert isinstance(reply, Reply)
    assert (reply.reply_to, reply.correlation_id, reply.reply.id) == ("reply.q", "c-1", "r-1")
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.INTERNAL
    assert reply.reply.error.message == (
        "scheduler error while admitting the request: KeyError: 'boom'"
    )
