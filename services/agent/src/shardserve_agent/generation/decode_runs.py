"""The pieces of a decode run (``StepWork.decode_steps`` K > 1) that are not the loop itself.

In a decode run every rank runs its (only) stage K times over the same sequences, one token
each: iteration i + 1 feeds back the tokens iteration i sampled. These helpers make each
iteration's inputs, layout and sampling from the step's (``Iteration``), keep collective
step numbers apart between iterations (``OffsetCollective``) and digest the run's tokens
(``tokens_digest``: what every rank reports, so the scheduler sees that they agreed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardserve.amqp.collective import Combine
from shardserve.repo.repository import AllGatherOp, AllReduceOp, StageSpec
from shardserve.runtime.attention import StepLayout
from shardserve.runtime.program import Collective, Env
from shardserve.wire.protocol import RowSampling, StepWork
from shardserve.wire.tensors import Tensor, digest_tensors


def collectives_per_run(stage: StageSpec) -> int:
    """How many collective step numbers one run of the stage program uses (at least 1)."""
    return max(1, sum(isinstance(op, AllGatherOp | AllReduceOp) for op in stage.program))


class OffsetCollective:
    """A job's collective seen by one iteration: step numbers moved ``offset`` further on.

    The hub buffers parts by (job, step) for the whole job, and a run is one job; a faster
    peer's part of iteration i + 1 must not land in the buffer of iteration i's step."""

    def __init__(self, inner: Collective, offset: int) -> None:
        self._inner = inner
        self._offset = offset

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        return await self._inner.gather(step + self._offset, array)

    async def allreduce(self, step: int, array: np.ndarray) -> np.ndarray:
        return await self._inner.allreduce(step + self._offset, array)

    async def allcombine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        return await self._inner.allcombine(step + self._offset, array, combine)

    async def to_leader(
        self, step: int, array: np.ndarray, combine: Combine, *, reduce: bool
    ) -> np.ndarray | None:
        return await self._inner.to_leader(step + self._offset, array, combine, reduce=reduce)


@dataclass(frozen=True)
class Iteration:
    """What iteration ``index`` of a decode run feeds the stage and the sampler."""

    index: int
    inputs: Env
    layout: StepLayout
    sampling: tuple[RowSampling, ...]

    @classmethod
    def first(cls, work: StepWork, names: Sequence[str], *, logprobs: bool) -> Iteration:
        """The step's own rows; without ``logprobs`` (a rank that reports no tokens) the
        rows ask for none: they would be computed for nothing (the tokens are the same)."""
        inputs: Env = {name: work.inputs[name].to_numpy() for name in names}
        layout = StepLayout([(span.seq, span.start, span.count) for span in work.layout])
        sampling = work.sampling
        if not logprobs:
            sampling = tuple(
                row if row.logprobs is None else row.model_copy(update={"logprobs": None})
                for row in sampling
            )
        return cls(0, inputs, layout, sampling)

    def next(self, tokens: Sequence[int]) -> Iteration:
        """The following iteration: each row's sampled token one position further on."""
        inputs = dict(self.inputs)
        inputs["input_ids"] = np.asarray(tokens, np.int64)
        inputs["positions"] = self.inputs["positions"] + 1
        layout = StepLayout([(s.seq_id, s.start + 1, s.count) for s in self.layout.spans])
        sampling = tuple(row.after(token) for row, token in zip(self.sampling, tokens, strict=True))
        return Iteration(self.index + 1, inputs, layout, sampling)


def tokens_digest(tokens: Sequence[Sequence[int]]) -> str:
    """The digest of a run's sampled tokens, ``[iteration, row]`` (the same on every rank
    that sampled the same tokens)."""
    array = np.asarray(tokens, np.int64).reshape(len(tokens), -1)
    return digest_tensors({"tokens": Tensor.from_numpy(array)})
