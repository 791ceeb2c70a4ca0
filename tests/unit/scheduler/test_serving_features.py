"""Python stages, dynamic batching, per-instance outcomes, pipelining, versions: pure, with a
manual clock (Python tasks are run inline, as the shell's worker pool would)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.errors import ErrorCode
from shardserve.repo.repository import GroupConfig, write_group
from shardserve.repo.signature import ANY_DATATYPE
from shardserve.wire.protocol import InferRequest, TensorSpec
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core import batching, rescan
from shardserve_scheduler.core.actions import Action, PublishStageWork, Reply, RunPython
from shardserve_scheduler.core.catalog import load_catalog
from shardserve_scheduler.core.methods import MethodPlan, ModelStep, PythonStep, default_method
from shardserve_scheduler.core.pystages import PythonTask, run_python_task
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import Call, RequestMachine
from shardserve_scheduler.core.resolve import resolve

ANY = TensorSpec(name="a", datatype=ANY_DATATYPE, shape=())


def of(kind: type, actions: list[Action]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def batch_group(kit: Any, *, fixed: int = 0, stage_size: int = 1) -> GroupConfig:
    group = kit.group(rank_size=2 * stage_size, stage_size=stage_size)
    spec = TensorSpec(name="x", datatype="FP32", shape=(-1, 3))
    return group.model_copy(
        update={
            "with_batch_dim": True,
            "max_batch_size": fixed,
            "inputs": (spec,),
            "outputs": (spec.model_copy(update={"name": "y"}),),
        }
    )


def rows(*values: float, width: int = 3) -> Tensor:
    return Tensor.from_numpy(np.array([[v] * width for v in values], np.float32))


def request(rid: str, *instances: dict[str, Tensor], **kw: Any) -> InferRequest:
    return InferRequest(
        id=rid, servable="matmul", instances=instances, deadline=kw.get("deadline", 100.0)
    )


def machine(**kw: Any) -> RequestMachine:
    kw.setdefault("batch_delay", 0.002)
    return RequestMachine(result_to="results.q", id_prefix="t", **kw)


def call(group: GroupConfig, req: InferRequest, plan: MethodPlan | None = None) -> Call:
    return Call(req, "reply.q", f"c-{req.id}", group, plan or default_method(group))


def answer(kit: Any, m: RequestMachine, work: PublishStageWork, group: Any) -> list[Action]:
    actions: list[Action] = []
    for rank in group.stages[work.work.stage].ranks:
        actions += m.on_result(kit.result(work, rank, group), 1.0)
    return actions


def run_to_replies(kit: Any, m: RequestMachine, group: Any, actions: list[Action]) -> list[Reply]:
    """Play ranks and the Python pool until nothing is left to do."""
    replies: list[Reply] = []
    pending = list(actions)
    while pending:
        action = pending.pop(0)
        if isinstance(action, Reply):
            replies.append(action)
        elif isinstance(action, RunPython):
            pending += m.on_python_done(action.task.id, run_python_task(action.task), 1.0)
        elif isinstance(action, PublishStageWork):
            pending += answer(kit, m, action, group)
    return replies


# ---------------------------------------------------------------- batching


def test_instances_of_several_requests_share_a_batch_flushed_by_delay(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.002)
    assert m.accept(call(group, request("a", {"x": rows(1)})), 0.0) == []
    assert m.accept(call(group, request("b", {"x": rows(2, 3)})), 0.001) == []
    assert m.next_wakeup() == pytest.approx(0.002)
    assert m.tick(0.0019) == []
    (work,) = of(PublishStageWork, m.tick(0.002))
    np.testing.assert_array_equal(work.work.inputs["x"].to_numpy()[:, 0], [1, 2, 3])
    assert work.work.requests == ("a", "b")
    replies = {r.reply.id: r.reply for r in of(Reply, answer(kit, m, work, group))}
    a_out = replies["a"].instances[0].outputs
    b_out = replies["b"].instances[0].outputs
    assert a_out is not None and b_out is not None
    np.testing.assert_array_equal(a_out["y"].to_numpy()[:, 0], [2])
    np.testing.assert_array_equal(b_out["y"].to_numpy()[:, 0], [3, 4])
    stats = m.version_stats("matmul", 1)
    assert (stats.batches_total, stats.batched_instances_total, stats.requests_total) == (1, 2, 2)


def test_instances_being_batched_fill_the_queue_and_the_refusal_says_so(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=10.0, max_inflight=1, queue_factor=2)
    for rid in "abc":  # 3 places: 1 in flight + 2 waiting, all held by the open batch
        assert m.accept(call(group, request(rid, {"x": rows(1)})), 0.0) == []
    (refused,) = of(Reply, m.accept(call(group, request("d", {"x": rows(1)})), 0.0))
    error = refused.reply.error
    assert error is not None and error.code == ErrorCode.OVERLOADED
    assert error.message == (
        "servable matmul is overloaded: 0 jobs in flight, 0 queued, 3 instance(s) being "
        "batched (at most 1 in flight and 2 waiting: --max-inflight 1)"
    )
    (work,) = of(PublishStageWork, m.tick(10.0))  # the batch leaves: room again
    assert work.work.requests == ("a", "b", "c")
    assert m.accept(call(group, request("e", {"x": rows(1)})), 10.0) == []


def test_a_full_batch_is_sent_at_once(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=4, batch_delay=10.0)
    assert m.accept(call(group, request("a", {"x": rows(1, 2)})), 0.0) == []
    (work,) = of(PublishStageWork, m.accept(call(group, request("b", {"x": rows(3, 4)})), 0.0))
    assert work.work.inputs["x"].shape == (4, 3)
    assert m.next_wakeup() is None


def test_a_fixed_batch_dim_is_padded_with_zeros_and_padding_dropped(kit: Any) -> None:
    group = batch_group(kit, fixed=4)
    m = machine(max_batch_size=32, batch_delay=0.0)
    (work,) = of(PublishStageWork, m.accept(call(group, request("a", {"x": rows(5)})), 0.0))
    np.testing.assert_array_equal(work.work.inputs["x"].to_numpy()[:, 0], [5, 0, 0, 0])
    (reply,) = of(Reply, answer(kit, m, work, group))
    outputs = reply.reply.instances[0].outputs
    assert outputs is not None and outputs["y"].shape == (1, 3)


def test_an_oversized_instance_is_chunked_and_reassembled_in_order(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=2, batch_delay=0.0)
    works = of(
        PublishStageWork, m.accept(call(group, request("a", {"x": rows(1, 2, 3, 4, 5)})), 0.0)
    )
    # the two full chunks leave at once; the partial one waits while the stage is busy
    assert [w.work.inputs["x"].shape[0] for w in works] == [2, 2]
    actions: list[Action] = []
    for work in reversed(works):  # answers arrive out of order
        released = answer(kit, m, work, group)
        actions += released
        works += of(PublishStageWork, released)
    assert [w.work.inputs["x"].shape[0] for w in works] == [2, 2, 1]
    actions += answer(kit, m, works[-1], group)
    (reply,) = of(Reply, actions)
    outputs = reply.reply.instances[0].outputs
    assert outputs is not None
    np.testing.assert_array_equal(outputs["y"].to_numpy()[:, 0], [2, 3, 4, 5, 6])


def test_a_due_batch_keeps_growing_while_every_stage_is_busy(kit: Any) -> None:
    """Instances that arrive while the ranks work join one job instead of many small ones."""
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.0)
    (first,) = of(PublishStageWork, m.accept(call(group, request("a", {"x": rows(1)})), 0.0))
    for i, name in enumerate("bcd"):
        assert of(PublishStageWork, m.accept(call(group, request(name, {"x": rows(i)})), 0.1)) == []
    assert of(PublishStageWork, m.tick(0.5)) == []  # due, but the stage is busy: no tick spin
    assert m.next_wakeup() is None
    (batch,) = of(PublishStageWork, answer(kit, m, first, group))
    assert batch.work.inputs["x"].shape[0] == 3  # b, c and d in one job


def test_only_identical_no_batch_inputs_share_a_batch(kit: Any) -> None:
    group = batch_group(kit)
    mask = TensorSpec(name="m", datatype="FP32", shape=(2,))
    group = group.model_copy(update={"inputs": (*group.inputs, mask)})
    plan = default_method(group)
    plan = MethodPlan(**{**plan.__dict__, "no_batch_inputs": frozenset({"m"})})
    m = machine(max_batch_size=8, batch_delay=0.0)
    one, two = (Tensor.from_numpy(np.full(2, v, np.float32)) for v in (1.0, 2.0))
    req = request("a", {"x": rows(1), "m": one}, {"x": rows(2), "m": two}, {"x": rows(3), "m": one})
    works = of(PublishStageWork, m.accept(call(group, req, plan), 0.0))
    assert len(works) == 2
    by_mask = {float(w.work.inputs["m"].to_numpy()[0]): w.work.inputs for w in works}
    np.testing.assert_array_equal(by_mask[1.0]["x"].to_numpy()[:, 0], [1, 3])
    assert by_mask[1.0]["m"].shape == (2,)  # passed through, not concatenated
    np.testing.assert_array_equal(by_mask[2.0]["x"].to_numpy()[:, 0], [2])


def test_only_rows_of_the_same_trailing_shape_and_dtype_share_a_batch(kit: Any) -> None:
    group = batch_group(kit)
    spec = TensorSpec(name="x", datatype=ANY_DATATYPE, shape=(-1, -1))
    group = group.model_copy(update={"inputs": (spec,)})
    m = machine(max_batch_size=8, batch_delay=0.0)
    wide = Tensor.from_numpy(np.ones((1, 4), np.float32))
    ints = Tensor.from_numpy(np.ones((1, 3), np.int32))
    req = request("a", {"x": rows(1)}, {"x": wide}, {"x": rows(2)}, {"x": ints})
    works = of(PublishStageWork, m.accept(call(group, req), 0.0))
    shapes = sorted((w.work.inputs["x"].dtype, w.work.inputs["x"].shape) for w in works)
    assert shapes == [("<f4", (1, 4)), ("<f4", (2, 3)), ("<i4", (1, 3))]
    replies = run_to_replies(kit, m, group, list(works))
    (reply,) = replies
    assert all(i.outputs is not None for i in reply.reply.instances)


def test_a_scheduler_bug_forming_a_batch_fails_that_request_at_once(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.0)

    def broken(*_: Any) -> Any:
        raise ValueError("boom")

    monkeypatch.setattr(batching, "combine", broken)
    actions = m.accept(call(group, request("a", {"x": rows(1)})), 0.0)
    (reply,) = of(Reply, actions)
    assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.INTERNAL
    assert reply.reply.error.message == "scheduler error while forming a batch: ValueError: boom"
    assert m.open_requests == 0 and of(PublishStageWork, actions) == []
    monkeypatch.undo()
    (work,) = of(PublishStageWork, m.accept(call(group, request("b", {"x": rows(2)})), 0.0))
    (ok,) = of(Reply, answer(kit, m, work, group))
    assert ok.reply.error is None and ok.reply.instances[0].outputs is not None


def test_a_bundle_admitted_then_settled_once_shares_one_job(kit: Any) -> None:
    """The shell admits every request of a bundle, then settles: with the lane free, the
    first request does not leave alone while the others wait for it to finish."""
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.0)
    admitted = [m.admit(call(group, request(rid, {"x": rows(1)})), 0.0) for rid in "abc"]
    assert admitted == [[], [], []]
    (work,) = of(PublishStageWork, m.settle(0.0))
    assert work.work.inputs["x"].shape == (3, 3)
    replies = of(Reply, answer(kit, m, work, group))
    assert sorted(r.reply.id for r in replies) == ["a", "b", "c"]
    assert all(r.reply.error is None for r in replies)


def test_a_bug_forming_a_bundles_batch_fails_each_of_its_requests_at_once(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.0)
    monkeypatch.setattr(batching, "combine", lambda *_: 1 / 0)
    for rid in "ab":
        m.admit(call(group, request(rid, {"x": rows(1)})), 0.0)
    replies = of(Reply, m.settle(0.0))
    assert sorted(r.reply.id for r in replies) == ["a", "b"]
    for r in replies:
        assert r.reply.error is not None and r.reply.error.code == ErrorCode.INTERNAL
        assert "while forming a batch: ZeroDivisionError" in r.reply.error.message
    assert m.open_requests == 0


def batch_of_a_and_b(kit: Any) -> tuple[RequestMachine, GroupConfig, PublishStageWork]:
    """Requests a and b (one row each) sent as one batch: the machine, group and work."""
    group = batch_group(kit)
    m = machine(max_batch_size=8, batch_delay=0.002)
    m.accept(call(group, request("a", {"x": rows(1)})), 0.0)
    m.accept(call(group, request("b", {"x": rows(2)})), 0.0)
    (work,) = of(PublishStageWork, m.tick(0.002))
    return m, group, work


def test_a_scheduler_bug_handling_a_result_fails_the_jobs_requests_at_once(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, group, work = batch_of_a_and_b(kit)

    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")  # (split's own ValueError is a known failure)

    monkeypatch.setattr(batching, "split", broken)
    replies = of(Reply, answer(kit, m, work, group))
    assert sorted(r.reply.id for r in replies) == ["a", "b"]
    for reply in replies:
        assert reply.reply.error is not None and reply.reply.error.code == ErrorCode.INTERNAL
        assert reply.reply.error.message.startswith("scheduler error handling a result of job ")
        assert reply.reply.error.message.endswith(": RuntimeError: boom")
    assert m.open_requests == 0 and not m.jobs


def test_max_batch_size_one_disables_batching(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(max_batch_size=1, batch_delay=5.0)
    works = of(
        PublishStageWork,
        m.accept(call(group, request("a", {"x": rows(1, 2)}, {"x": rows(3)})), 0.0),
    )
    assert [w.work.inputs["x"].shape[0] for w in works] == [2, 1]  # whole instances, at once


def test_instances_disagreeing_on_rows_fail_alone(kit: Any) -> None:
    group = batch_group(kit)
    two = TensorSpec(name="z", datatype="FP32", shape=(-1, 3))
    group = group.model_copy(update={"inputs": (*group.inputs, two)})
    m = machine(batch_delay=0.0)
    req = request("a", {"x": rows(1), "z": rows(1, 2)}, {"x": rows(2), "z": rows(2)})
    actions = m.accept(call(group, req), 0.0)
    (work,) = of(PublishStageWork, actions)
    (reply,) = of(Reply, answer(kit, m, work, group))
    bad, good = reply.reply.instances
    assert bad.error is not None and bad.error.code == ErrorCode.BAD_INPUT
    assert "disagree on the batch size" in bad.error.message
    assert good.outputs is not None


def test_deadline_of_one_batched_request_leaves_the_others_running(kit: Any) -> None:
    group = batch_group(kit)
    m = machine(batch_delay=0.0)
    m.accept(call(group, request("a", {"x": rows(1)}, deadline=5.0)), 0.0)
    # b waits in its batch while a's job holds the only stage
    assert of(PublishStageWork, m.accept(call(group, request("b", {"x": rows(2)})), 0.0)) == []
    assert of(PublishStageWork, m.tick(0.0)) == []
    actions = m.tick(5.0)
    (expired,) = of(Reply, actions)
    assert expired.reply.error is not None and expired.reply.error.code == ErrorCode.DEADLINE
    (work,) = of(PublishStageWork, actions)  # the stage is free again: b goes
    np.testing.assert_array_equal(work.work.inputs["x"].to_numpy()[:, 0], [2])


# ---------------------------------------------------------------- Python stages


def double(a: np.ndarray) -> np.ndarray:
    if a.ndim != 2:
        raise ValueError(f"expected a matrix, got {a.ndim} dims")
    return (a * 2).astype(np.float32)


def summed(y: np.ndarray) -> float:
    return float(y.sum())


def python_plan(pre: Any, post: Any, batch_size: int | None = None) -> MethodPlan:
    out = TensorSpec(name="out", datatype=ANY_DATATYPE, shape=())
    steps = (
        PythonStep(1, "Preprocess", pre, ((0, 0),), 1, batch_size),
        ModelStep(2, ((1, 0),)),
        PythonStep(3, "Postprocess", post, ((2, 0),), 1, batch_size),
    )
    return MethodPlan("predict_sum", (ANY,), (out,), steps, ((3, 0),), ("x",), ("y",))


def test_python_pre_and_post_processing_around_the_model(kit: Any) -> None:
    group = kit.group()
    m = machine()
    req = request("a", {"a": Tensor.from_numpy(np.ones((2, 3), np.float32))})
    actions = m.accept(call(group, req, python_plan(double, summed)), 0.0)
    (run,) = of(RunPython, actions)
    assert of(PublishStageWork, actions) == []  # the model waits for the Python stage
    (reply,) = run_to_replies(kit, m, group, actions)
    outputs = reply.reply.instances[0].outputs
    assert outputs is not None
    assert outputs["out"].to_numpy() == pytest.approx(6 * 3.0)  # (1*2 + 1) summed


def test_a_python_stage_error_is_per_instance_with_the_mindspore_message(kit: Any) -> None:
    group = kit.group()
    m = machine()
    good = Tensor.from_numpy(np.ones((2, 3), np.float32))
    req = request("a", {"a": good}, {"a": Tensor.from_numpy(np.ones(3, np.float32))})
    req = req.model_copy(update={"method": "predict_sum"})
    (reply,) = run_to_replies(
        kit, m, group, m.accept(call(group, req, python_plan(double, summed)), 0.0)
    )
    ok, bad = reply.reply.instances
    assert ok.outputs is not None
    assert bad.error is not None and bad.error.code == ErrorCode.BAD_INPUT
    assert bad.error.message == (
        "Call Preprocess Failed, method: 'predict_sum', stage index(begin with 1): 1, "
        "error msg: expected a matrix, got 1 dims"
    )


def test_other_exceptions_are_stage_failures() -> None:
    def broken(a: Any) -> Any:
        raise RuntimeError("tokenizer crashed")

    step = PythonStep(3, "Postprocess", broken, ((2, 0),), 1)
    (outcome,) = run_python_task(PythonTask("p1", "m", step, ((rows(1),),)))
    assert not isinstance(outcome, tuple) and outcome.code == ErrorCode.STAGE_FAILED
    assert outcome.message.endswith("stage index(begin with 1): 3, error msg: tokenizer crashed")


def test_python_outputs_become_tensors() -> None:
    def many(a: Any) -> Any:
        return np.float32(1.5), True, 7, "text", b"\x00\xff", np.arange(3)

    step = PythonStep(1, "Pre", many, ((0, 0),), 6)
    (outcome,) = run_python_task(PythonTask("p1", "m", step, ((rows(1),),)))
    assert isinstance(outcome, tuple)
    assert [t.datatype for t in outcome] == ["FP32", "BOOL", "INT64", "BYTES", "BYTES", "INT64"]
    assert outcome[3].to_numpy().reshape(-1)[0] == b"text"
    bad = PythonStep(1, "Pre", lambda a: object(), ((0, 0),), 1)
    (error,) = run_python_task(PythonTask("p2", "m", bad, ((rows(1),),)))
    assert not isinstance(error, tuple) and error.code == ErrorCode.STAGE_FAILED
    assert "not supported" in error.message


def test_batched_python_stage_gets_lists_of_instances(kit: Any) -> None:
    group = kit.group()
    calls: list[int] = []

    def pre_batch(instances: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
        calls.append(len(instances))
        return [double(a) for (a,) in instances]

    def post_batch(instances: list[tuple[np.ndarray, ...]]) -> Any:
        for (y,) in instances:
            yield summed(y)

    m = machine(max_batch_size=32)
    ones = {"a": Tensor.from_numpy(np.ones((2, 3), np.float32))}
    plan = python_plan(pre_batch, post_batch, batch_size=2)
    actions = m.accept(call(group, request("a", ones, ones, ones), plan), 0.0)
    runs = of(RunPython, actions)
    assert [len(r.task.args) for r in runs] == [2, 1]  # at most batch_size per call
    (reply,) = run_to_replies(kit, m, group, actions)
    assert calls == [2, 1]
    assert all(r.outputs is not None for r in reply.reply.instances)


def test_a_batched_function_returning_too_few_results_fails_its_instances() -> None:
    step = PythonStep(1, "Pre", lambda batch: [1], ((0, 0),), 1, 0)
    outcomes = run_python_task(PythonTask("p", "m", step, ((rows(1),), (rows(2),))))
    assert all(not isinstance(o, tuple) and o.code == ErrorCode.STAGE_FAILED for o in outcomes)
    assert "returned 1 result(s) for 2 instance(s)" in str(outcomes[0])


def test_late_python_results_after_a_deadline_are_ignored(kit: Any) -> None:
    group = kit.group()
    m = machine()
    ones = {"a": Tensor.from_numpy(np.ones((2, 3), np.float32))}
    (run,) = of(
        RunPython,
        m.accept(call(group, request("a", ones, deadline=1.0), python_plan(double, summed)), 0.0),
    )
    (reply,) = of(Reply, m.tick(1.0))
    assert (
        reply.reply.error is not None and "Python stage 1 (Preprocess)" in reply.reply.error.message
    )
    assert m.on_python_done(run.task.id, run_python_task(run.task), 1.1) == []
    assert not m.jobs and m.open_requests == 0


# ---------------------------------------------------------------- pipelining


def test_stage_zero_of_the_next_job_goes_out_after_the_previous_moves_on(kit: Any) -> None:
    group = kit.group(rank_size=4, stage_size=2)
    m = machine(max_inflight=2)
    (a0,) = of(PublishStageWork, m.accept(call(group, request("a", {"x": kit.tensor(1.0)})), 0.0))
    (b0,) = of(PublishStageWork, m.accept(call(group, request("b", {"x": kit.tensor(2.0)})), 0.0))
    assert (
        of(PublishStageWork, m.accept(call(group, request("c", {"x": kit.tensor(3.0)})), 0.0)) == []
    )
    # a leaves stage 0 for stage 1; b is still in stage 0: both in flight, c waits
    (a1,) = of(PublishStageWork, answer(kit, m, a0, group))
    assert (a1.work.stage, a1.work.requests) == (1, ("a",))
    # a finishes: its reply, then c's stage 0, in that order, from one action list
    actions = answer(kit, m, a1, group)
    kinds = [
        (type(x).__name__, getattr(getattr(x, "work", None), "stage", None))
        for x in actions
        if isinstance(x, (Reply, PublishStageWork))
    ]
    assert kinds == [("Reply", None), ("PublishStageWork", 0)]
    assert of(PublishStageWork, actions)[0].work.requests == ("c",)
    assert b0.work.stage == 0


def test_max_inflight_one_runs_one_job_at_a_time(kit: Any) -> None:
    group = kit.group(rank_size=4, stage_size=2)
    m = machine(max_inflight=1)
    (a0,) = of(PublishStageWork, m.accept(call(group, request("a", {"x": kit.tensor()})), 0.0))
    assert of(PublishStageWork, m.accept(call(group, request("b", {"x": kit.tensor()})), 0.0)) == []
    (a1,) = of(PublishStageWork, answer(kit, m, a0, group))
    assert a1.work.stage == 1  # b does not enter stage 0 while a is in stage 1
    (b0,) = of(PublishStageWork, answer(kit, m, a1, group))
    assert b0.work.requests == ("b",)


# ---------------------------------------------------------------- versions


def test_a_new_version_folder_is_picked_up_and_a_removed_one_reported(
    kit: Any, tmp_path: Path
) -> None:
    (tmp_path / "matmul" / "1").mkdir(parents=True)
    write_group(tmp_path / "matmul" / "1", kit.group())
    catalog = load_catalog(tmp_path)
    registry = Registry.build(catalog.groups(), 0.0)
    for rank in (0, 1):
        kit.join(registry, rank, 0.0, f"v1-{rank}")
    (tmp_path / "matmul" / "2").mkdir()
    write_group(tmp_path / "matmul" / "2", kit.group(version=2))
    (tmp_path / "other" / "1").mkdir(parents=True)
    (tmp_path / "other" / "1" / "group.json").write_text("{not json")
    result = rescan.scan(tmp_path, rescan.served_keys(catalog), {}, set())
    added = rescan.apply(catalog, result)
    assert [(g.servable, g.version) for g in added] == [("matmul", 2)]
    assert "not valid JSON" in catalog.servables["other"].broken_versions[1]
    for config in added:
        registry.add_group(config)
    # v2 has no agents yet: version 0 still resolves to v1
    assert resolve(catalog, registry, kit.request(), "r", "c").group.version == 1
    for rank in (0, 1):
        kit.join(registry, rank, 1.0, f"v2-{rank}", version=2)
    assert resolve(catalog, registry, kit.request(), "r", "c").group.version == 2
    assert resolve(catalog, registry, kit.request(version=1), "r", "c").group.version == 1
    # an operator-unloaded version is not brought back by a scan
    assert rescan.scan(tmp_path, rescan.served_keys(catalog), {}, set()).loaded == {}
    import shutil

    shutil.rmtree(tmp_path / "matmul" / "1")
    result = rescan.scan(tmp_path, rescan.served_keys(catalog), rescan.broken_keys(catalog), set())
    assert result.removed == [("matmul", 1)]


def test_unloading_refuses_explicit_requests_and_version_zero_skips_it(
    kit: Any, tmp_path: Path
) -> None:
    for version in (1, 2):
        (tmp_path / "matmul" / str(version)).mkdir(parents=True)
        write_group(tmp_path / "matmul" / str(version), kit.group(version=version))
    catalog = load_catalog(tmp_path)
    registry = Registry.build(catalog.groups(), 0.0)
    for version in (1, 2):
        for rank in (0, 1):
            kit.join(registry, rank, 0.0, f"v{version}-{rank}", version=version)
    catalog.unloading.add(("matmul", 2))
    assert resolve(catalog, registry, kit.request(), "r", "c").group.version == 1
    with pytest.raises(Exception, match="version 2 is unloading"):
        resolve(catalog, registry, kit.request(version=2), "r", "c")
    assert registry.remove_group("matmul", 2) == ["v2-0", "v2-1"]
    catalog.drop(("matmul", 2))
    assert registry.hello(kit.hello(0, "v2-0", version=2), 1.0).reason.startswith(
        "unknown version 2"
    )
    with pytest.raises(Exception, match="version 2 not found"):
        resolve(catalog, registry, kit.request(version=2), "r", "c")
