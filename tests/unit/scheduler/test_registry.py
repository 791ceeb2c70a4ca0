"""The agent registry, with a manual clock."""

from __future__ import annotations

from typing import Any

from shardserve_scheduler.core.registry import Registry


def build(kit: Any, rank_size: int = 2, **kwargs: Any) -> Registry:
    return Registry.build([kit.group(rank_size=rank_size)], 0.0, **kwargs)


def test_group_ready_when_every_rank_joined(kit: Any) -> None:
    reg = build(kit)
    group = reg.groups[("matmul", 1)]
    assert group.not_ready_reason() == "matmul v1 is not ready: ranks 0, 1 missing"
    kit.join(reg, 0, 1.0)
    assert not group.ready
    assert group.not_ready_reason() == "matmul v1 is not ready: rank 1 missing"
    kit.join(reg, 1, 1.0)
    assert group.ready and group.not_ready_reason() == ""


def test_an_accepted_rank_is_loading_until_its_first_heartbeat(kit: Any) -> None:
    """The agent declares its work queues after the verdict; until it beats, no work may be
    routed to it, so the group stays unready."""
    reg = build(kit)
    group = reg.groups[("matmul", 1)]
    kit.join(reg, 0, 0.0)
    assert reg.hello(kit.hello(1), 1.0).accepted
    assert group.slots[1].state == "loading" and not group.ready
    assert group.not_ready_reason() == "matmul v1 is not ready: rank 1 loading"
    # A repeated hello (scheduler restart, SchedulerHello) does not make it ready either.
    assert reg.hello(kit.hello(1), 1.2).accepted
    assert not group.ready
    assert reg.heartbeat(kit.hello(1, heartbeat=True), 1.5)
    assert group.ready


def test_refusal_of_a_held_rank_says_when_the_holder_would_time_out(kit: Any) -> None:
    reg = build(kit, heartbeat_timeout=3.0)
    kit.join(reg, 1, 10.0, "first")
    verdict = reg.hello(kit.hello(1, "second"), 11.0)
    assert not verdict.accepted
    # 3 s timeout - 1 s since the holder was last heard + 0.5 s margin
    assert verdict.retry_after_s == 2.5
    reg.heartbeat(kit.hello(1, "first", heartbeat=True), 12.0)
    assert reg.hello(kit.hello(1, "second"), 12.0).retry_after_s == 3.5
    # Refusals that waiting cannot cure carry no retry hint.
    assert reg.hello(kit.hello(1, "x", checksum="f" * 64), 12.0).retry_after_s == 0.0
    assert reg.hello(kit.hello(0, servable="nope"), 12.0).retry_after_s == 0.0
    # Once the holder timed out, the newcomer is accepted.
    reg.tick(15.1)
    assert reg.hello(kit.hello(1, "second"), 15.2).accepted


def test_rank_outside_the_group_is_refused(kit: Any) -> None:
    reg = build(kit, rank_size=8)
    verdict = reg.hello(kit.hello(9, per_stage=8), 0.0)
    assert not verdict.accepted
    assert verdict.reason == "rank 9 is outside group matmul v1 (rank_size 8)"


def test_rank_served_by_another_live_instance_is_refused_naming_it(kit: Any) -> None:
    reg = build(kit)
    assert reg.hello(kit.hello(1, "first"), 0.0).accepted
    verdict = reg.hello(kit.hello(1, "second"), 0.5)
    assert not verdict.accepted
    assert "already served by instance first" in verdict.reason
    assert "host hostA, pid 1001" in verdict.reason
    # The holder itself may say hello again (scheduler restart, broker blip).
    assert reg.hello(kit.hello(1, "first"), 1.0).accepted


def test_checksum_mismatch_is_refused(kit: Any) -> None:
    reg = build(kit)
    verdict = reg.hello(kit.hello(0, checksum="f" * 64), 0.0)
    assert not verdict.accepted
    assert verdict.reason.startswith("slice checksum mismatch for rank 0 of matmul v1")


def test_unknown_servable_or_version_is_refused(kit: Any) -> None:
    reg = build(kit)
    verdict = reg.hello(kit.hello(0, servable="nope"), 0.0)
    assert not verdict.accepted and "unknown servable 'nope'" in verdict.reason
    verdict = reg.hello(kit.hello(0, version=4), 0.0)
    assert not verdict.accepted
    assert verdict.reason == "unknown version 4 of servable 'matmul' (versions: 1)"


def test_wrong_stage_is_refused(kit: Any) -> None:
    reg = build(kit)
    verdict = reg.hello(kit.hello(0, stage=1), 0.0)
    assert not verdict.accepted and "is in stage 0, agent says 1" in verdict.reason


def test_heartbeat_timeout_loses_the_rank_and_the_group_heals(kit: Any) -> None:
    reg = build(kit, heartbeat_timeout=3.0)
    kit.join(reg, 0, 0.0)
    kit.join(reg, 1, 0.0)
    assert reg.heartbeat(kit.hello(0, heartbeat=True), 2.0)
    assert reg.tick(3.0) == []
    losses = reg.tick(3.5)
    assert [(x.servable, x.version, x.ranks) for x in losses] == [("matmul", 1, (1,))]
    assert losses[0].message == "matmul v1 lost rank 1 (no heartbeat for 3 s)"
    group = reg.groups[("matmul", 1)]
    assert group.not_ready_reason() == "matmul v1 is not ready: rank 1 lost"
    assert reg.tick(3.6) == []  # reported once
    # The same instance comes back (its heartbeats resume): healed.
    assert reg.heartbeat(kit.hello(1, heartbeat=True), 4.0)
    assert group.ready


def test_a_new_instance_may_take_a_lost_rank(kit: Any) -> None:
    reg = build(kit, heartbeat_timeout=3.0)
    kit.join(reg, 0, 0.0)
    kit.join(reg, 1, 0.0, "old")
    reg.heartbeat(kit.hello(0, heartbeat=True), 4.0)
    reg.tick(4.0)
    kit.join(reg, 1, 4.1, "new")
    assert reg.groups[("matmul", 1)].ready
    # The old instance's heartbeats no longer count.
    assert not reg.heartbeat(kit.hello(1, "old", heartbeat=True), 4.2)


def test_heartbeat_from_an_unknown_instance_is_ignored(kit: Any) -> None:
    reg = build(kit)
    assert not reg.heartbeat(kit.hello(0, "stranger", heartbeat=True), 0.0)
    assert reg.ignored_heartbeats == 1
    assert reg.groups[("matmul", 1)].slots[0].state == "missing"


def test_bye_makes_the_rank_missing(kit: Any) -> None:
    reg = build(kit)
    kit.join(reg, 0, 0.0)
    bye = kit.hello(0)
    from shardserve.wire.protocol import AgentBye

    loss = reg.bye(AgentBye(**bye.model_dump(exclude={"kind"})))
    assert loss is not None and loss.ranks == (0,)
    assert reg.groups[("matmul", 1)].slots[0].state == "missing"


def test_loading_and_draining_agents_keep_the_group_unready(kit: Any) -> None:
    reg = build(kit)
    kit.join(reg, 0, 0.0, state="loading")
    kit.join(reg, 1, 0.0, state="draining")
    reason = reg.groups[("matmul", 1)].not_ready_reason()
    assert reason == "matmul v1 is not ready: rank 1 draining; rank 0 loading"


def test_wait_agents_timeout_is_reported_once_and_the_group_may_still_heal(kit: Any) -> None:
    reg = build(kit, wait_agents_seconds=5.0)
    kit.join(reg, 0, 1.0)
    assert reg.expired_waits(4.9) == []
    failures = reg.expired_waits(5.0)
    assert failures == [
        "Failed to wait for ready of all agents of matmul v1, current agents count: 1, rank size: 2"
    ]
    assert "Failed to wait" in reg.groups[("matmul", 1)].not_ready_reason()
    assert reg.expired_waits(6.0) == []
    reg.heartbeat(kit.hello(0, heartbeat=True), 6.0)
    kit.join(reg, 1, 6.0)
    assert reg.groups[("matmul", 1)].ready


def test_status_reports_heartbeat_age(kit: Any) -> None:
    reg = build(kit)
    kit.join(reg, 0, 1.0)
    slot = reg.groups[("matmul", 1)].slots[0]
    status = slot.status(2.5)
    assert status.heartbeat_age_s == 1.5 and status.pid == 1000 and status.state == "ready"
    assert reg.groups[("matmul", 1)].slots[1].status(2.5).heartbeat_age_s is None
