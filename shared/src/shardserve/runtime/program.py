"""The stage program interpreter: ONNX segments and collectives over an environment.

Every rank of a stage runs the same program (from group.json) on its own segment files.
The interpreter is shared by the agent (collectives over RabbitMQ) and by offline
checks (``LocalGroup`` runs all ranks of a stage in one process), so the numerics that
tests prove offline are the numerics served.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shardserve.amqp.collective import Combine, sum_in_rank_order
from shardserve.errors import InternalError
from shardserve.repo.repository import (
    AllGatherOp,
    AllReduceOp,
    AttentionOp,
    GroupConfig,
    RunOp,
    StageSpec,
)
from shardserve.wire.tensors import BF16_DTYPE, is_bfloat16

if TYPE_CHECKING:
    from shardserve.runtime.attention import SoleSequence

Env = dict[str, np.ndarray]


class SegmentRunner(Protocol):
    """Something that runs one ONNX segment (an onnxruntime session, in practice)."""

    input_names: tuple[str, ...]

    async def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    async def run_each(
        self, feed_list: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]]:
        """``run`` for each feed set in turn (the instances of a stacked job)."""
        ...


class Collective(Protocol):
    """Exchange of one tensor per rank among the ranks of a stage, for step ``step``: what
    every collective offers (``GatherCollective`` makes the last three from ``gather``)."""

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        """Return every rank's array for this step, in rank order (own included)."""
        ...

    async def allreduce(self, step: int, array: np.ndarray) -> np.ndarray:
        """The rank-order sum of every rank's array, identical bits on every rank."""
        ...

    async def allcombine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        """``combine`` of every rank's array in rank order, identical bits on every rank."""
        ...

    async def to_leader(
        self, step: int, array: np.ndarray, combine: Combine, *, reduce: bool
    ) -> np.ndarray | None:
        """``combine`` of every rank's array at the stage leader; None on a rank that only
        contributes. A collective without point-to-point sends returns it on every rank."""
        ...


class GatherCollective(ABC):
    """A collective that has only ``gather``: every rank gathers every part and combines
    them itself (one-rank stages, in-process stages, test fakes)."""

    @abstractmethod
    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        """Return every rank's array for this step, in rank order (own included)."""

    async def allreduce(self, step: int, array: np.ndarray) -> np.ndarray:
        return sum_in_rank_order(await self.gather(step, array))

    async def allcombine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        return combine(await self.gather(step, array))

    async def to_leader(
        self, step: int, array: np.ndarray, combine: Combine, *, reduce: bool
    ) -> np.ndarray | None:
        return await self.allcombine(step, array, combine)


class AttentionContext(Protocol):
    """What an ``attention`` op calls: the rank's KV cache and the step's packed layout
    (``shardserve.runtime.attention.StepAttention``)."""

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray: ...

    def sole_sequence(self) -> SoleSequence | None:
        """The step's one sequence (a composed piece attends over it in place), or None."""
        ...


class ComposedParts(Protocol):
    """A rank's composed pieces and the runners of the segments they hold."""

    @property
    def pieces(self) -> Mapping[int, ComposedRun]: ...

    @property
    def runners(self) -> Mapping[str, SegmentRunner]: ...


class ComposedRun(Protocol):
    """A composed piece of the program (ops ``first`` .. ``stop`` - 1) run in one go over
    one sequence (``shardserve.runtime.pieces.Piece``)."""

    @property
    def stop(self) -> int: ...

    @property
    def whole(self) -> SegmentRunner: ...

    def feeds(self, env: Mapping[str, np.ndarray], sole: SoleSequence) -> dict[str, np.ndarray]: ...


async def run_stage(
    stage: StageSpec,
    runners: Mapping[str, SegmentRunner],
    inputs: Env,
    collective: Collective,
    *,
    stacked: int = 0,
    outputs_at_leader: bool = False,
    attention: AttentionContext | None = None,
    pieces: Mapping[int, ComposedRun] | None = None,
) -> Env:
    """Run ``stage.program`` from ``inputs``; return the stage's declared outputs.

    ``stacked`` > 0: every tensor holds that many instances on a new leading axis (a model
    without a batch dimension, several requests in one job). Each segment runs once per
    instance, exactly as it would alone; each collective exchanges the stacked array in
    one part (an allgather's axis moves one place right), so a job of k instances costs
    the ranks one message per collective instead of k.

    ``outputs_at_leader``: the stage's final collectives (``StageSpec.final_collectives``) combine
    at the stage leader only, where the collective can (``to_leader``); the other ranks
    then return no outputs at all (an empty mapping).

    ``attention``: the context ``attention`` ops call (required when the program has one).

    ``pieces`` (by the program index of their first op): composed pieces, each run in one
    go instead of its ops one by one when the step's rows are one sequence's."""
    env: Env = dict(inputs)
    finals = stage.final_collectives if outputs_at_leader else frozenset()
    step = 0
    sole = attention.sole_sequence() if attention is not None and not stacked else None
    composed = pieces if sole is not None and pieces else {}
    resume = 0  # the next op not run as part of a composed piece
    for index, op in enumerate(stage.program):
        piece = composed.get(index)
        if index < resume or piece is not None:
            if piece is not None and sole is not None:
                env.update(await piece.whole.run(piece.feeds(env, sole)))
                resume = piece.stop
            continue
        if isinstance(op, RunOp):
            runner = runners[op.file]
            feeds = {name: env[name] for name in runner.input_names}
            if stacked:
                env.update(await _run_stacked(runner, feeds, stacked))
            else:
                env.update(await runner.run(feeds))
            continue
        if isinstance(op, AttentionOp):
            env[op.output] = _attend(attention, op, env, stacked)
            continue
        shifted = _shifted(op, stacked)
        if index in finals:
            result = await _at_leader(collective, step, shifted, env[op.input])
        else:
            result = await _combined(collective, step, shifted, env[op.input])
        if result is not None:
            env[op.output] = result
        step += 1
    return {name: env[name] for name in stage.outputs if name in env}


def _attend(
    attention: AttentionContext | None, op: AttentionOp, env: Env, stacked: int
) -> np.ndarray:
    if attention is None or stacked:
        raise InternalError(
            f"layer {op.layer} attention needs a KV cache context and unstacked tensors "
            f"(context given: {attention is not None}, stacked: {stacked})"
        )
    return attention.attend(op.layer, env[op.q], env[op.k], env[op.v])


async def _at_leader(
    collective: Collective, step: int, op: AllGatherOp | AllReduceOp, array: np.ndarray
) -> np.ndarray | None:
    """The collective's result at the leader; None on the ranks that only contribute."""
    return await collective.to_leader(
        step, array, partial(combine, op), reduce=isinstance(op, AllReduceOp)
    )


async def _run_stacked(
    runner: SegmentRunner, feeds: Mapping[str, np.ndarray], count: int
) -> dict[str, np.ndarray]:
    """Run ``runner`` once per stacked instance; stack each output back."""
    for name, array in feeds.items():
        if array.ndim == 0 or array.shape[0] != count:
            raise ValueError(
                f"stacked input {name!r} has shape {list(array.shape)}, expected {count} "
                "instances on its first axis"
            )
    outputs = await runner.run_each([{n: a[i] for n, a in feeds.items()} for i in range(count)])
    return {name: np.stack([out[name] for out in outputs]) for name in outputs[0]}


def _shifted(op: AllGatherOp | AllReduceOp, stacked: int) -> AllGatherOp | AllReduceOp:
    """The collective on stacked arrays: an allgather along axis a >= 0 of one instance is
    along a + 1 of the stack (a negative axis counts from the end: unchanged)."""
    if stacked and isinstance(op, AllGatherOp) and op.axis >= 0:
        return op.model_copy(update={"axis": op.axis + 1})
    return op


async def _combined(
    collective: Collective, step: int, op: AllGatherOp | AllReduceOp, array: np.ndarray
) -> np.ndarray:
    """The collective's result on every rank, by ``allreduce``/``allcombine`` (the
    collective may combine on one rank, or each rank a shard, and share the result)."""
    if isinstance(op, AllReduceOp):
        return await collective.allreduce(step, array)
    return await collective.allcombine(step, array, partial(combine, op))


def combine(op: AllGatherOp | AllReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate (allgather) or sum in rank order (allreduce): identical bits on every rank."""
    if isinstance(op, AllGatherOp):
        return np.concatenate(parts, axis=op.axis)
    return sum_in_rank_order(parts)


# A segment whose last run took less than this runs inline on the event loop next time.
# A thread hand-off costs every run a submit, a worker wake-up, a loop wake-up and the GIL
# back (~40 us of wall and ~30 us of CPU here), and a tensor-parallel decode step runs 25
# segments between 17 collectives, each on the critical path of both ranks. bench-large at
# TP 2 (one sequence, 2 cores, load 3-5, two alternating pairs of runs), each rank's compute
# per step: 25-31 ms inline up to 20 ms, 33-42 ms with 1 ms. Blocking the
# loop that long delays nothing that matters: heartbeats are 1 s apart, and a peer's part
# that arrives meanwhile waits in the socket, where this rank could not use it sooner.
# Anything slower (a big prefill), or fed much more data than last time (a bigger batch),
# goes to a thread so the loop keeps serving.
INLINE_RUN_S = 0.02
INLINE_WALL_S = 0.05  # wall time beyond which CPU time is not trusted (other threads)
INLINE_GROWTH = 2  # inline only while the feeds are at most this many times last run's


class OrtSegment:
    """A SegmentRunner over an onnxruntime session: in a thread off the event loop, or
    inline when its last run was short (``INLINE_RUN_S``)."""

    def __init__(self, session: object, run_in_thread: bool = True) -> None:
        self._session = session
        self.input_names = tuple(i.name for i in session.get_inputs())  # type: ignore[attr-defined]
        outputs = session.get_outputs()  # type: ignore[attr-defined]
        self._output_names = [o.name for o in outputs]
        # A BF16 output cannot come back through session.run (no numpy type for it).
        self._bf16_out = any(getattr(o, "type", "") == "tensor(bfloat16)" for o in outputs)
        self._threaded = run_in_thread
        self._last_s = float("inf")  # unknown until the first run: that one is threaded
        self._last_bytes = 0

    def run_sync(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Timed here, not around the thread hand-off: the decision is about the compute.
        # CPU time of this thread, so a busy machine preempting us does not count; a long
        # wall time on little CPU (onnxruntime's own threads working) still counts.
        wall, cpu = time.perf_counter(), time.thread_time()
        if self._bf16_out or any(is_bfloat16(a.dtype) for a in feeds.values()):
            values = _run_with_ort_values(self._session, self._output_names, feeds)
        else:
            values = self._session.run(self._output_names, dict(feeds))  # type: ignore[attr-defined]
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        self._last_s = cpu if wall < INLINE_WALL_S else wall
        return dict(zip(self._output_names, values, strict=True))

    async def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        [outputs] = await self.run_each([feeds])
        return outputs

    async def run_each(
        self, feed_list: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]]:
        """Every run inline when all of them together are expected to be short, else all
        in one thread hand-off: a stacked job of k instances pays one hop, not k."""
        if not self._threaded:
            return self._run_all(feed_list)
        size = max((sum(int(a.nbytes) for a in f.values()) for f in feed_list), default=0)
        expected = self._last_s * len(feed_list)
        inline = expected < INLINE_RUN_S and size <= INLINE_GROWTH * max(self._last_bytes, 1)
        self._last_bytes = size
        if inline:
            return self._run_all(feed_list)
        return await asyncio.to_thread(self._run_all, feed_list)

    def _run_all(
        self, feed_list: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]]:
        return [self.run_sync(feeds) for feeds in feed_list]

    @property
    def runs_inline(self) -> bool:
        """Whether the next run (with feeds no bigger than the last) stays on the loop."""
        return self._threaded and self._last_s < INLINE_RUN_S


# onnx TensorProto.BFLOAT16. onnxruntime's numpy binding has no bfloat16 (it refuses an
# ml_dtypes.bfloat16 array: "Numpy_type 256 can't be converted to MLDataType"), so a BF16
# feed goes in as an OrtValue over the array's uint16 bits tagged with this element type.
_ONNX_BFLOAT16 = 16


def _run_with_ort_values(
    session: object, output_names: list[str], feeds: Mapping[str, np.ndarray]
) -> list[np.ndarray]:
    """Run with every feed wrapped as an OrtValue (which may carry BF16)."""
    from onnxruntime import OrtValue

    values = {name: _ort_value(OrtValue, array) for name, array in feeds.items()}
    outputs = session.run_with_ort_values(output_names, values)  # type: ignore[attr-defined]
    return [_to_numpy(output) for output in outputs]


def _to_numpy(value: Any) -> np.ndarray:
    """An output OrtValue as numpy; BF16 is copied out by its bits (``OrtValue.numpy``
    refuses it) into an ml_dtypes.bfloat16 array."""
    if value.data_type() != "tensor(bfloat16)":
        array: np.ndarray = value.numpy()
        return array
    from shardserve.wire.tensors import numpy_dtype  # imports ml_dtypes only when needed

    shape = tuple(value.shape())
    raw = ctypes.string_at(value.data_ptr(), 2 * math.prod(shape))
    return np.frombuffer(raw, np.uint16).view(numpy_dtype(BF16_DTYPE)).reshape(shape)


def _ort_value(ort_value_type: Any, array: np.ndarray) -> object:
    array = np.ascontiguousarray(array)
    if is_bfloat16(array.dtype):
        bits = array.view(np.uint16)
        return ort_value_type.ortvalue_from_numpy_with_onnx_type(bits, _ONNX_BFLOAT16)
    return ort_value_type.ortvalue_from_numpy(array)


class _LocalCollective(GatherCollective):
    def __init__(self, group: _LocalStageGroup, index: int) -> None:
        self._group = group
        self._index = index

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        return await self._group.contribute(step, self._index, array)


class _LocalStageGroup:
    """In-process collectives for the ranks of one stage (for offline checks)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._parts: dict[int, dict[int, np.ndarray]] = {}
        self._done: dict[int, asyncio.Event] = {}

    async def contribute(self, step: int, index: int, array: np.ndarray) -> list[np.ndarray]:
        parts = self._parts.setdefault(step, {})
        event = self._done.setdefault(step, asyncio.Event())
        parts[index] = array
        if len(parts) == self._size:
            event.set()
        await event.wait()
        return [parts[i] for i in range(self._size)]


SessionFactory = Callable[[Path], object]


def _default_session(path: Path) -> object:
    import onnxruntime as ort

    from shardserve.runtime.thread_pools import set_threads

    options = ort.SessionOptions()
    set_threads(options, 1)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


async def run_group_locally(
    repo: Path,
    group: GroupConfig,
    inputs: Env,
    session_factory: SessionFactory | None = None,
    *,
    stacked: int = 0,
    attention: Sequence[AttentionContext] | None = None,
    composed: Callable[[int], ComposedParts] | None = None,
) -> list[Env]:
    """Run a whole group in this process: every stage, every rank. Returns, per last-stage
    rank, its outputs (they must all be equal). ``stacked``: as for ``run_stage``;
    ``attention``: one context per rank (indexed by rank) for programs with attention ops;
    ``composed``: per rank, its composed pieces and their segments' runners (the
    segments they hold are not opened on their own)."""
    from shardserve.repo.repository import verify_rank_files

    make = session_factory or _default_session
    current: Env = dict(inputs)
    results: list[Env] = []
    for stage in group.stages:
        local = _LocalStageGroup(len(stage.ranks))
        jobs = []
        for index, rank in enumerate(stage.ranks):
            files = verify_rank_files(repo, group, rank)
            # Only the segments the program runs: a rank may also hold ONNX external data.
            runs = {op.file for op in stage.program if isinstance(op, RunOp)}
            parts = composed(rank) if composed is not None else None
            held = parts.runners if parts is not None else {}
            runners: dict[str, SegmentRunner] = {
                name: held.get(name) or OrtSegment(make(path), run_in_thread=False)
                for name, path in files.items()
                if name in runs
            }
            collective = _LocalCollective(local, index)
            context = attention[rank] if attention is not None else None
            pieces = parts.pieces if parts is not None else None
            jobs.append(
                run_stage(
                    stage,
                    runners,
                    current,
                    collective,
                    stacked=stacked,
                    attention=context,
                    pieces=pieces,
                )
            )
        results = list(await asyncio.gather(*jobs))
        current = results[0]
    return results
