"""What jobs and generation steps share on a rank: the checks before running (addressed to
this rank's stage, inputs intact) and the outputs' wire form and digest after."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from shardserve.wire.tensors import Tensor, digest_mismatch, digest_tensors, tensor_bytes
from shardserve_agent.slice_loader import LoadedSlice

# Tensors bigger than this are digested and converted in a thread: a 64 MB activation
# takes tens of ms to hash and copy, and the event loop must keep heartbeating. Below, a
# thread hand-off costs more than the work: a TP8 rank digesting 1-1.5 MiB stacked jobs
# in a thread served 25-35 % fewer binary requests per second than inline.
OFF_LOOP_BYTES = 4 * 1024 * 1024


def _finished_tensors(outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Tensor], str]:
    tensors = {name: Tensor.from_numpy(array) for name, array in outputs.items()}
    return tensors, digest_tensors(tensors)


async def finished(outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Tensor], str]:
    """The outputs as wire tensors and their digest; in a thread when they are big."""
    if sum(int(a.nbytes) for a in outputs.values()) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_finished_tensors, outputs)
    return _finished_tensors(outputs)


def identity_problem(
    loaded: LoadedSlice, servable: str, version: int, stage_index: int, inputs: Mapping[str, Tensor]
) -> str | None:
    """Why work addressed to (servable, version, stage) with ``inputs`` cannot run on this
    rank, or None."""
    rank, stage, group = loaded.rank, loaded.stage, loaded.group
    if (servable, version, stage_index) != (group.servable, group.version, stage.index):
        return (
            f"rank {rank} serves {group.servable} v{group.version} stage {stage.index}, "
            f"got work for {servable} v{version} stage {stage_index}"
        )
    missing = [name for name in stage.inputs if name not in inputs]
    if missing:
        return f"rank {rank}: stage {stage.index} input(s) {', '.join(missing)} missing"
    return None


async def digest_problem(rank: int, inputs: Mapping[str, Tensor], expected: str) -> str | None:
    """Why the inputs do not match the digest their sender computed, or None."""
    if tensor_bytes(inputs) > OFF_LOOP_BYTES:
        digest = await asyncio.to_thread(digest_tensors, inputs)
    else:
        digest = digest_tensors(inputs)
    problem = digest_mismatch(expected, digest, "digest mismatch (corrupted in transit?)")
    return f"rank {rank}: stage input {problem}" if problem else None


def describe_failure(rank: int, exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return f"rank {rank} failed to run its stage: {type(exc).__name__}: {text}"[:2000]
