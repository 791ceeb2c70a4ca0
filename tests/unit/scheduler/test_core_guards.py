"""A bug in the scheduler core (an unexpected exception) costs only the instance or request
it struck: every other request of the same event keeps its reply, and the one struck is
answered at once (INTERNAL, the message naming the bug) instead of never. Pure, with a
manual clock; the bug is injected by patching a step the core calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_serving_features import (
    answer,
    batch_group,
    batch_of_a_and_b,
    call,
    double,
    machine,
    of,
    python_plan,
    request,
    summed,
)

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import InferReply
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core import batching, requests
from shardserve_scheduler.core.actions import PublishStageWork, Reply, RunPython
from shardserve_scheduler.core.pystages import run_python_task


def failing_on_call(number: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``number``-th call (from 1) raises RuntimeError('boom')."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == number:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    return wrapper


def each(function: Callable[[np.ndarray], Any]) -> Callable[[list[tuple[Any, ...]]], list[Any]]:
    """A batched Python stage (it gets a list of instances) applying ``function`` to each."""
    return lambda instances: [function(a) for (a,) in instances]


def by_id(replies: list[Reply]) -> dict[str, InferReply]:
    return {r.reply.id: r.reply for r in replies}


def assert_bug(reply: InferReply, doing: str) -> None:
    assert reply.error is not None and reply.error.code == ErrorCode.INTERNAL
    assert reply.error.message.startswith(f"scheduler error {doing}")
    assert reply.error.message.endswith(": RuntimeError: boom")


def test_a_bug_ending_one_member_of_a_batch_keeps_the_other_members_replies(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, group, work = batch_of_a_and_b(kit)
    monkeypatch.setattr(batching, "join_chunks", failing_on_call(2, batching.join_chunks))
    replies = by_id(of(Reply, answer(kit, m, work, group)))
    assert sorted(replies) == ["a", "b"]
    assert replies["a"].error is None and replies["a"].instances[0].outputs is not None
    assert_bug(replies["b"], "handling a result of job ")
    assert m.open_requests == 0 and not m.jobs


def test_a_bug_ending_a_request_at_its_deadline_still_answers_it_and_the_others(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = kit.group()
    m = machine()
    for rid in ("a", "b"):
        m.accept(call(group, request(rid, {"x": kit.tensor(1.0)}, deadline=1.0)), 0.0)
    monkeypatch.setattr(
        requests, "_deadline_message", failing_on_call(1, requests._deadline_message)
    )
    replies = by_id(of(Reply, m.tick(1.0)))
    assert sorted(replies) == ["a", "b"]
    assert_bug(replies["a"], "ending the request at its deadline")
    late = replies["b"].error
    assert late is not None and late.code == ErrorCode.DEADLINE
    assert m.open_requests == 0


def test_a_bug_handling_a_python_stage_result_fails_that_instance_alone(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.002)
    plan = python_plan(each(double), each(summed), batch_size=0)  # batched Python stages
    ones = {"a": Tensor.from_numpy(np.ones((1, 3), np.float32))}
    for rid in ("a", "b"):
        (pre,) = of(RunPython, m.accept(call(group, request(rid, ones), plan), 0.0))
        m.on_python_done(pre.task.id, run_python_task(pre.task), 0.0)
    (work,) = of(PublishStageWork, m.tick(0.002))  # a and b in one model run
    (post,) = of(RunPython, answer(kit, m, work, group))
    assert len(post.task.args) == 2  # ... and in one Python task after it
    monkeypatch.setattr(m.progress, "advance", failing_on_call(2, m.progress.advance))
    replies = by_id(of(Reply, m.on_python_done(post.task.id, run_python_task(post.task), 1.0)))
    assert sorted(replies) == ["a", "b"]
    outputs = replies["a"].instances[0].outputs
    assert replies["a"].error is None and outputs is not None
    assert outputs["out"].to_numpy() == pytest.approx(3 * 3.0)  # (1*2 + 1) summed
    assert_bug(replies["b"], "handling the result of Python task ")
    assert m.open_requests == 0


def test_a_bug_while_starting_queued_work_loses_no_reply_already_made(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = kit.group()
    m = machine(max_inflight=1)
    (first,) = of(PublishStageWork, m.accept(call(group, request("a", {"x": kit.tensor(1.0)})), 0))
    m.accept(call(group, request("b", {"x": kit.tensor(2.0)})), 0.0)  # queued behind a
    monkeypatch.setattr(m.lanes, "pump", failing_on_call(1, m.lanes.pump))
    (reply,) = of(Reply, answer(kit, m, first, group))
    assert reply.reply.id == "a" and reply.reply.error is None
    monkeypatch.undo()
    (second,) = of(PublishStageWork, m.tick(0.5))  # the next event starts what waits
    assert second.work.requests == ("b",)
