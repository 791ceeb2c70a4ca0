"""The request/job state machine: events in, actions out, manual clock."""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

import numpy as np

from shardserve.errors import ErrorCode
from shardserve.repo.repository import AllGatherOp, RunOp
from shardserve.wire.protocol import ErrorInfo
from shardserve.wire.tensors import digest_tensors
from shardserve_scheduler.core.actions import Action, Cancel, Log, PublishStageWork, Reply
from shardserve_scheduler.core.requests import RequestMachine


def machine(
    max_inflight: int = 64, queue_factor: int = 10, max_batch_size: int = 1
) -> RequestMachine:
    """Without batching by default: one job per instance (stacking is tested on its own)."""
    return RequestMachine(
        result_to="results.q",
        id_prefix="t",
        max_inflight=max_inflight,
        queue_factor=queue_factor,
        max_batch_size=max_batch_size,
    )


def of(kind: type, actions: list[Action]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def only_reply(actions: list[Action]) -> Reply:
    replies = of(Reply, actions)
    assert len(replies) == 1, actions
    return replies[0]


def answer_stage(
    kit: Any, m: RequestMachine, work: PublishStageWork, group: Any, now: float = 1.0
) -> list[Action]:
    actions: list[Action] = []
    for rank in group.stages[work.work.stage].ranks:
        actions += m.on_result(kit.result(work, rank, group), now)
    return actions


def test_one_stage_happy_path(kit: Any) -> None:
    group = kit.group(rank_size=2)
    m = machine()
    actions = m.accept(kit.call(group, kit.request("r1")), 0.0)
    (work,) = of(PublishStageWork, actions)
    assert work.routing_key == "matmul.1.s0"
    assert work.work.stage == 0 and work.work.result_to == "results.q"
    assert work.work.digest == digest_tensors(work.work.inputs)
    assert work.work.requests == ("r1",)
    first = m.on_result(kit.result(work, 1, group), 0.5)
    assert first == []
    actions = m.on_result(kit.result(work, 0, group), 0.6)
    reply = only_reply(actions)
    assert reply.reply_to == "reply.q" and reply.correlation_id == "c1"
    assert reply.reply.error is None and reply.reply.version == 1
    (instance,) = reply.reply.instances
    assert instance.outputs is not None
    np.testing.assert_array_equal(instance.outputs["y"].to_numpy(), np.ones((2, 3)))
    timeline = [a for a in of(Log, actions) if a.level == logging.DEBUG]
    assert timeline and "s0 publish" in timeline[0].message and "s0 r1" in timeline[0].message
    assert m.open_requests == 0 and not m.jobs


def test_two_stages_pass_the_leader_outputs_on(kit: Any) -> None:
    group = kit.group(rank_size=4, stage_size=2)
    m = machine()
    (work0,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    actions = answer_stage(kit, m, work0, group)
    (work1,) = of(PublishStageWork, actions)
    assert work1.routing_key == "matmul.1.s1" and work1.work.job == work0.work.job
    assert set(work1.work.inputs) == {"h1"}
    np.testing.assert_array_equal(work1.work.inputs["h1"].to_numpy(), np.ones((2, 3)))
    assert work1.work.digest == digest_tensors(work1.work.inputs)
    reply = only_reply(answer_stage(kit, m, work1, group))
    assert reply.reply.instances[0].outputs is not None
    np.testing.assert_array_equal(
        reply.reply.instances[0].outputs["y"].to_numpy(), np.full((2, 3), 2.0)
    )


def test_digest_mismatch_names_the_ranks_that_disagree(kit: Any) -> None:
    group = kit.group(rank_size=4)
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    actions: list[Action] = []
    for rank in range(3):
        actions += m.on_result(kit.result(work, rank, group), 1.0)
    actions += m.on_result(kit.result(work, 3, group, value=7.0), 1.0)
    reply = only_reply(actions)
    assert reply.reply.error is not None
    assert reply.reply.error.code == ErrorCode.INTERNAL
    message = reply.reply.error.message
    assert message.startswith("ranks disagree on stage 0 output: ranks [0, 1, 2] digest ")
    assert ", ranks [3] digest " in message


def test_a_digest_of_another_version_is_named_not_called_a_mismatch(kit: Any) -> None:
    group = kit.group(rank_size=2)
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    actions: list[Action] = []
    for rank in range(2):
        result = kit.result(work, rank, group).model_copy(update={"digest": "ab" * 16})
        actions += m.on_result(result, 1.0)
    reply = only_reply(actions)
    assert reply.reply.error is not None
    assert reply.reply.error.code == ErrorCode.INTERNAL
    message = reply.reply.error.message
    assert message.startswith("stage 0 leader rank 0 of ")
    assert "digest 'abababab" in message and "another shardserve version" in message


def test_a_rank_error_fails_the_request_at_once_and_cancels_the_job(kit: Any) -> None:
    group = kit.group(rank_size=4)
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    m.on_result(kit.result(work, 0, group), 1.0)
    error = ErrorInfo(code=ErrorCode.INTERNAL, message="onnxruntime exploded")
    actions = m.on_result(kit.result(work, 2, group, error=error), 1.1)
    reply = only_reply(actions)
    assert reply.reply.error is not None
    assert reply.reply.error.message == "rank 2 failed stage 0 of matmul v1: onnxruntime exploded"
    (cancel,) = of(Cancel, actions)
    assert cancel.cancel.job == work.work.job and cancel.routing_key == "group.matmul.1"
    # The other ranks' answers arrive later and change nothing.
    assert m.on_result(kit.result(work, 1, group), 1.2) == []
    assert m.counters.late_results == 1


def test_rank_error_codes_outside_the_stage_family_become_stage_failed(kit: Any) -> None:
    group = kit.group()
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    error = ErrorInfo(code=ErrorCode.BAD_INPUT, message="digest mismatch on input")
    reply = only_reply(m.on_result(kit.result(work, 1, group, error=error), 1.0))
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.STAGE_FAILED


def test_deadline_replies_and_cancels(kit: Any) -> None:
    group = kit.group()
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request(deadline=5.0)), 0.0))
    m.on_result(kit.result(work, 0, group), 1.0)
    assert m.tick(4.9) == []
    actions = m.tick(5.0)
    reply = only_reply(actions)
    assert reply.reply.error is not None
    assert reply.reply.error.code == ErrorCode.DEADLINE
    assert "no result yet from ranks 1" in reply.reply.error.message
    assert len(of(Cancel, actions)) == 1
    assert m.tick(6.0) == [] and m.open_requests == 0


def test_deadline_already_passed_on_arrival(kit: Any) -> None:
    m = machine()
    reply = only_reply(m.accept(kit.call(kit.group(), kit.request(deadline=1.0)), 2.0))
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.DEADLINE


def test_rank_lost_fails_in_flight_and_queued_jobs_at_once(kit: Any) -> None:
    group = kit.group()
    other = kit.group(servable="other")
    m = machine(max_inflight=1)
    (w1,) = of(PublishStageWork, m.accept(kit.call(group, kit.request("a"), "ca"), 0.0))
    assert of(PublishStageWork, m.accept(kit.call(group, kit.request("b"), "cb"), 0.0)) == []
    of(PublishStageWork, m.accept(kit.call(other, kit.request("c", servable="other"), "cc"), 0.0))
    actions = m.on_rank_lost("matmul", 1, "matmul v1 lost rank 1 (no heartbeat for 3 s)", 1.0)
    replies = of(Reply, actions)
    assert sorted(r.correlation_id for r in replies) == ["ca", "cb"]
    for r in replies:
        assert r.reply.error.code == ErrorCode.RANK_LOST
        assert r.reply.error.message == "matmul v1 lost rank 1 (no heartbeat for 3 s)"
    assert [c.cancel.job for c in of(Cancel, actions)] == [w1.work.job]  # b was never published
    assert of(PublishStageWork, actions) == []  # nor is it now
    assert m.open_requests == 1  # the other servable's request is untouched


def test_late_and_duplicate_results_are_ignored_and_counted(kit: Any) -> None:
    group = kit.group()
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    assert m.on_result(kit.result(work, 0, group), 1.0) == []
    assert m.on_result(kit.result(work, 0, group), 1.0) == []
    assert m.counters.duplicate_results == 1
    only_reply(m.on_result(kit.result(work, 1, group), 1.0))
    assert m.on_result(kit.result(work, 1, group), 1.0) == []
    assert m.counters.late_results == 1


def test_bounded_inflight_queues_fifo_then_refuses(kit: Any) -> None:
    group = kit.group()
    m = machine(max_inflight=2, queue_factor=1)
    works = []
    for i in range(4):
        works += of(PublishStageWork, m.accept(kit.call(group, kit.request(f"r{i}"), f"c{i}"), 0.0))
    assert [w.work.requests for w in works] == [("r0",), ("r1",)]
    reply = only_reply(m.accept(kit.call(group, kit.request("r4"), "c4"), 0.0))
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.OVERLOADED
    assert "2 jobs in flight, 2 queued" in reply.reply.error.message
    assert m.inflight("matmul", 1) == 2
    # r1 finishes first: r2 (the oldest waiting) starts.
    actions = answer_stage(kit, m, works[1], group)
    assert only_reply(actions).correlation_id == "c1"
    (started,) = of(PublishStageWork, actions)
    assert started.work.requests == ("r2",)


def test_pipelining_two_jobs_in_different_stages(kit: Any) -> None:
    group = kit.group(rank_size=4, stage_size=2)
    m = machine()
    (a0,) = of(PublishStageWork, m.accept(kit.call(group, kit.request("a"), "ca"), 0.0))
    (b0,) = of(PublishStageWork, m.accept(kit.call(group, kit.request("b"), "cb"), 0.0))
    (a1,) = of(PublishStageWork, answer_stage(kit, m, a0, group))
    assert a1.work.stage == 1 and a1.work.requests == ("a",)
    (b1,) = of(PublishStageWork, answer_stage(kit, m, b0, group))
    assert only_reply(answer_stage(kit, m, a1, group)).correlation_id == "ca"
    assert only_reply(answer_stage(kit, m, b1, group)).correlation_id == "cb"


def test_several_instances_become_jobs_and_one_reply_in_order(kit: Any) -> None:
    group = kit.group()
    m = machine()
    works = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=3)), 0.0))
    assert len(works) == 3
    actions: list[Action] = []
    for work in reversed(works):
        actions += answer_stage(kit, m, work, group)
    reply = only_reply(actions)
    values = [r.outputs["y"].to_numpy()[0, 0] for r in reply.reply.instances]  # type: ignore[index]
    assert values == [1.0, 2.0, 3.0]


def test_a_failing_instance_gets_its_own_error_and_the_others_their_outputs(kit: Any) -> None:
    group = kit.group()
    m = machine()
    works = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=2)), 0.0))
    error = ErrorInfo(code=ErrorCode.STAGE_FAILED, message="boom")
    actions = m.on_result(kit.result(works[0], 0, group, error=error), 1.0)
    assert of(Reply, actions) == []  # instance 1 is still running
    assert [c.cancel.job for c in of(Cancel, actions)] == [works[0].work.job]
    reply = only_reply(answer_stage(kit, m, works[1], group))
    assert reply.reply.error is None
    first, second = reply.reply.instances
    assert first.error is not None and first.error.code == ErrorCode.STAGE_FAILED
    assert first.error.message == "rank 0 failed stage 0 of matmul v1: boom"
    assert second.outputs is not None and second.error is None
    assert not m.jobs


def test_instances_failing_the_same_way_collapse_into_one_request_error(kit: Any) -> None:
    group = kit.group()
    m = machine()
    works = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=2)), 0.0))
    actions = m.on_rank_lost("matmul", 1, "matmul v1 lost rank 1 (bye)", 1.0)
    reply = only_reply(actions)
    assert reply.reply.instances == ()
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.RANK_LOST
    assert sorted(c.cancel.job for c in of(Cancel, actions)) == sorted(w.work.job for w in works)


def test_requested_outputs_are_filtered(kit: Any) -> None:
    group = kit.group()
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request(outputs=("y",))), 0.0))
    reply = only_reply(answer_stage(kit, m, work, group))
    assert set(reply.reply.instances[0].outputs or {}) == {"y"}


def test_shutdown_replies_unavailable_to_every_open_request(kit: Any) -> None:
    group = kit.group()
    m = machine(max_inflight=1)
    m.accept(kit.call(group, kit.request("a"), "ca"), 0.0)
    m.accept(kit.call(group, kit.request("b"), "cb"), 0.0)
    replies = of(Reply, m.shutdown("scheduler shutting down", 1.0))
    assert sorted(r.correlation_id for r in replies) == ["ca", "cb"]
    assert all(r.reply.error.code == ErrorCode.UNAVAILABLE for r in replies)
    assert m.open_requests == 0 and not m.jobs


def test_publish_failure_fails_the_request(kit: Any) -> None:
    group = kit.group()
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    reply = only_reply(m.on_publish_failed(work.work.job, "broker is unreachable", 0.1))
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.UNAVAILABLE


class _Recorder:
    def __init__(self) -> None:
        self.replies: Counter[str] = Counter()
        self.published: list[PublishStageWork] = []

    def run(self, actions: list[Action]) -> None:
        self.published.extend(of(PublishStageWork, actions))
        self.replies.update(r.correlation_id for r in of(Reply, actions))
        assert all(count == 1 for count in self.replies.values()), self.replies


def _random_session(kit: Any, group: Any, seed: int) -> None:
    rng = random.Random(seed)
    m = machine(max_inflight=3, queue_factor=2)
    rec = _Recorder()
    sent = 0
    now = 0.0
    for _ in range(80):
        now += rng.random() * 0.2
        roll = rng.random()
        if roll < 0.25:
            request = kit.request(
                f"r{sent}", instances=rng.randint(1, 3), deadline=now + rng.random() * 4
            )
            rec.run(m.accept(kit.call(group, request, f"c{sent}"), now))
            sent += 1
        elif roll < 0.85 and rec.published:
            work = rng.choice(rec.published)
            rank = rng.choice(group.stages[work.work.stage].ranks)
            error = (
                ErrorInfo(code=ErrorCode.STAGE_FAILED, message="x") if rng.random() < 0.05 else None
            )
            value = 9.0 if rng.random() < 0.03 else None
            rec.run(m.on_result(kit.result(work, rank, group, error=error, value=value), now))
        elif roll < 0.9:
            rec.run(m.on_rank_lost("matmul", 1, "lost", now))
        else:
            rec.run(m.tick(now))
    rec.run(m.shutdown("bye", now) if rng.random() < 0.5 else m.tick(now + 10))
    assert sorted(rec.replies) == sorted(f"c{i}" for i in range(sent)), seed
    assert m.open_requests == 0 and not m.jobs


def test_exactly_one_reply_per_request_under_random_event_orders(kit: Any) -> None:
    """Random interleavings of results, errors, duplicates, losses, deadlines, shutdown:
    no request is ever answered twice, and every request is answered by the end."""
    group = kit.group(rank_size=4, stage_size=2)
    for seed in range(60):
        _random_session(kit, group, seed)


# ---------------------------------------------------------------- stacking (no batch dim)


def test_instances_without_batch_dim_stack_while_the_stage_is_busy(kit: Any) -> None:
    group = kit.group()
    m = machine(max_batch_size=8)
    (first,) = of(PublishStageWork, m.accept(kit.call(group, kit.request("a"), "ca"), 0.0))
    assert first.work.stacked == 0  # the stage was free: it left alone, at once
    for name in "bcd":
        assert (
            of(PublishStageWork, m.accept(kit.call(group, kit.request(name), f"c{name}"), 0.1))
            == []
        )
    actions = answer_stage(kit, m, first, group)
    assert only_reply(actions).correlation_id == "ca"
    (stacked,) = of(PublishStageWork, actions)
    assert stacked.work.stacked == 3 and stacked.work.requests == ("b", "c", "d")
    assert stacked.work.inputs["x"].shape == (3, 2, 3)
    replies = of(Reply, answer_stage(kit, m, stacked, group))
    assert [r.correlation_id for r in replies] == ["cb", "cc", "cd"]
    for reply in replies:
        (result,) = reply.reply.instances
        assert result.outputs is not None and result.outputs["y"].shape == (2, 3)


def test_instances_of_one_request_travel_as_one_stacked_job(kit: Any) -> None:
    group = kit.group()
    m = machine(max_batch_size=8)
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=3)), 0.0))
    assert work.work.stacked == 3
    reply = only_reply(answer_stage(kit, m, work, group))
    values = [r.outputs["y"].to_numpy()[0, 0] for r in reply.reply.instances]  # type: ignore[index]
    assert values == [1.0, 2.0, 3.0]


def test_a_stacked_job_that_fails_fails_every_instance_in_it(kit: Any) -> None:
    group = kit.group()
    m = machine(max_batch_size=8)
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=2)), 0.0))
    error = ErrorInfo(code=ErrorCode.STAGE_FAILED, message="boom")
    reply = only_reply(m.on_result(kit.result(work, 0, group, error=error), 1.0))
    # Every instance failed the same way: the reply carries that one error.
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.STAGE_FAILED
    assert reply.reply.error.message == "rank 0 failed stage 0 of matmul v1: boom"


def test_a_stacked_output_without_the_stack_axis_is_an_internal_error(kit: Any) -> None:
    group = kit.group(rank_size=1)
    m = machine(max_batch_size=8)
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request(instances=2)), 0.0))
    reply = only_reply(m.on_result(kit.result(work, 0, group, value=1.0, shape=(3, 3)), 1.0))
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.INTERNAL
    assert "expected the 2 stacked instances" in reply.reply.error.message


def _gathered_at_leader(group: Any) -> Any:
    """The same group, its stage ending in an allgather (a final collective)."""
    program = (RunOp(file="seg.onnx"), AllGatherOp(input="y_part", output="y", axis=1))
    stages = tuple(s.model_copy(update={"program": program}) for s in group.stages)
    return group.model_copy(update={"stages": stages})


def test_a_stage_whose_outputs_are_combined_at_the_leader_ends_with_its_result(
    kit: Any,
) -> None:
    """The other ranks' parts are in the leader's result: they send nothing on success."""
    group = _gathered_at_leader(kit.group(rank_size=4))
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    reply = only_reply(m.on_result(kit.result(work, 0, group), 1.0))
    assert reply.reply.error is None
    np.testing.assert_array_equal(reply.reply.instances[0].outputs["y"].to_numpy(), np.ones((2, 3)))
    assert m.open_requests == 0 and not m.jobs


def test_an_error_of_a_rank_that_sends_no_result_still_fails_the_job(kit: Any) -> None:
    group = _gathered_at_leader(kit.group(rank_size=4))
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    error = ErrorInfo(code=ErrorCode.INTERNAL, message="onnxruntime exploded")
    actions = m.on_result(kit.result(work, 2, group, error=error), 0.5)
    reply = only_reply(actions)
    assert reply.reply.error is not None
    assert reply.reply.error.message == "rank 2 failed stage 0 of matmul v1: onnxruntime exploded"
    assert of(Cancel, actions)


def test_without_outputs_at_the_leader_its_result_alone_does_not_end_the_stage(
    kit: Any,
) -> None:
    group = kit.group(rank_size=4)  # the stage ends in a segment run: every rank answers
    m = machine()
    (work,) = of(PublishStageWork, m.accept(kit.call(group, kit.request()), 0.0))
    assert m.on_result(kit.result(work, 0, group), 1.0) == []
    assert m.open_requests == 1
