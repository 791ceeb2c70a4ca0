"""A rank's composed pieces at run time: one onnxruntime session per piece
(``shardserve.runtime.compose``), run whole over one sequence's KV cache, or one segment
at a time for steps that pack several sequences.

The whole run binds the sequence's K/V of every layer of the piece with IO binding, as
``past_*`` and ``present_*`` of the same memory: GroupQueryAttention writes the step's new
rows into the cache in place and reads the earlier ones from it, nothing is copied. The
per-segment runs are ``OrtSegment``s like any other (threading, inline runs), over the
same session, so the weights are held (and prepacked) once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shardserve.errors import InternalError
from shardserve.repo.repository import AttentionOp, ProgramOp, RunOp, StageSpec
from shardserve.runtime.attention import SoleSequence
from shardserve.runtime.compose import (
    FUSED,
    SEQLENS_K,
    TOTAL_LENGTH,
    ComposedPiece,
    compose_piece,
    fed,
    past_names,
    piece_spans,
    present_names,
    run_flag,
)
from shardserve.runtime.light_model import graph_inputs, light_model
from shardserve.runtime.program import OrtSegment

__all__ = ["ComposedRank", "Piece", "compose_stage", "open_pieces"]

TRUE = np.array(True)
QUIET = 3  # onnxruntime's log severity: errors only
# Where a model given as bytes finds its external data (the rank folder).
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


@dataclass(frozen=True)
class _Port:
    """What OrtSegment reads of a session's inputs and outputs."""

    name: str
    type: str = "tensor(float)"


class Piece:
    """One composed piece of a stage program (ops ``first`` .. ``stop`` - 1) and its session."""

    def __init__(
        self,
        first: int,
        stop: int,
        composed: ComposedPiece,
        session: object,
        run_in_thread: bool = True,
    ) -> None:
        self.first, self.stop = first, stop
        self._threaded = run_in_thread
        self.composed = composed
        self.session = session
        self.whole = OrtSegment(_WholeView(self), run_in_thread)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.composed.inputs

    def segment(self, file: str) -> OrtSegment:
        """The runner of one of the piece's segments (steps that pack several sequences)."""
        view = _SegmentView(self, self.composed.segments.index(file))
        return OrtSegment(view, self._threaded)

    def feeds(self, env: Mapping[str, np.ndarray], sole: SoleSequence) -> dict[str, np.ndarray]:
        """The whole run's feeds: the piece's inputs and the sequence's K/V of its layers."""
        feeds = {name: env[name] for name in self.composed.inputs}
        end = sole.span.end
        feeds[SEQLENS_K] = np.array([end - 1], np.int32)
        feeds[TOTAL_LENGTH] = np.array(end, np.int32)
        for layer in self.composed.layers:
            kv = sole.layer(layer)
            for name, half in zip(past_names(layer), kv, strict=True):
                feeds[name] = half[None]
        return feeds


class _SegmentView:
    """The session seen as segment ``index``: only its If branch runs, its inputs fed."""

    def __init__(self, piece: Piece, index: int) -> None:
        self._piece = piece
        self._index = index
        composed = piece.composed
        file = composed.segments[index]
        self._reads = composed.segment_inputs[file]
        self._makes = composed.segment_outputs[file]
        self._outside = set(composed.inputs)
        self._flag = run_flag(index)

    def get_inputs(self) -> list[_Port]:
        return [_Port(name) for name in self._reads]

    def get_outputs(self) -> list[_Port]:
        return [_Port(name) for name in self._makes]

    def run(self, output_names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        # Every other input keeps its default: flags false, so no other segment and no
        # attention runs.
        full = {name if name in self._outside else fed(name): a for name, a in feeds.items()}
        full[self._flag] = TRUE
        outputs: list[np.ndarray] = self._piece.session.run(output_names, full)  # type: ignore[attr-defined]
        return outputs


class _WholeView:
    """The session run whole: every segment, attention inside, K/V bound in place.

    Binding a layer's K/V (in and out) costs ~3 us of Python a name: with the flags, the
    Python around a run took 1.14 ms of a 12 ms token on a 30-layer model (SmolLM2-135M
    int8, 2 threads, in process), 0.39 ms since (measured). A sequence's next step
    binds the same memory, so the binding is kept from one run to the next while the
    caches' addresses and shapes, the fed names and the asked outputs stay the same, and
    only the small inputs and the asked outputs are bound again; anything else makes a
    fresh one. Runs of one piece never overlap (a rank runs one step at a time).
    """

    def __init__(self, piece: Piece) -> None:
        self._piece = piece
        layers = piece.composed.layers
        self._caches = tuple(name for layer in layers for name in past_names(layer))
        self._cache_set = frozenset(self._caches)
        self._presents = [
            (past, present)
            for layer in layers
            for past, present in zip(past_names(layer), present_names(layer), strict=True)
        ]
        segments = range(len(piece.composed.segments))
        self._flags = (*(run_flag(index) for index in segments), FUSED)
        self._true = ort.OrtValue.ortvalue_from_numpy(TRUE)
        self._binding: object | None = None
        self._key: tuple[object, ...] = ()
        self._held: list[ort.OrtValue] = []  # the bound small inputs' memory

    def get_inputs(self) -> list[_Port]:
        return [_Port(name) for name in self._piece.composed.inputs]

    def get_outputs(self) -> list[_Port]:
        return [_Port(name) for name in self._piece.composed.outputs]

    def run(self, output_names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        binding = self._bound(output_names, feeds)
        self._held = []
        for name, array in feeds.items():
            if name not in self._cache_set:
                # (bind_cpu_input looks the name up among the inputs without a default)
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
                binding.bind_ortvalue_input(name, value)  # type: ignore[attr-defined]
                self._held.append(value)
        for name in output_names:  # a fresh output each run (its shape may change)
            binding.bind_output(name, "cpu")  # type: ignore[attr-defined]
        self._piece.session.run_with_iobinding(binding)  # type: ignore[attr-defined]
        # Only the asked outputs become arrays: the present K/V outputs after them are the
        # sequence's whole cache (tens of MB at long contexts), already written in place.
        asked = binding.get_outputs()[: len(output_names)]  # type: ignore[attr-defined]
        return [value.numpy() for value in asked]

    def _bound(self, output_names: list[str], feeds: Mapping[str, np.ndarray]) -> object:
        """The binding with the flags, the caches (in and out) and the asked outputs'
        places: the last run's when it holds the same, else a new one."""
        key = (
            tuple(output_names),
            tuple(feeds),
            tuple((feeds[name].ctypes.data, feeds[name].shape) for name in self._caches),
        )
        if self._binding is not None and key == self._key:
            return self._binding
        binding = self._piece.session.io_binding()  # type: ignore[attr-defined]
        for flag in self._flags:
            binding.bind_ortvalue_input(flag, self._true)
        for name in self._caches:
            _bind_cache(binding, name, feeds[name])
        for name in output_names:  # first: get_outputs lists them in binding order
            binding.bind_output(name, "cpu")
        for past, present in self._presents:
            _bind_cache(binding, present, feeds[past], output=True)
        self._binding, self._key = binding, key
        return binding


def _bind_cache(binding: object, name: str, array: np.ndarray, *, output: bool = False) -> None:
    """Bind a cache view by its address: past and present on the same memory."""
    if array.dtype != np.float32 or not array.flags.c_contiguous:
        raise InternalError(f"{name}: a KV cache view must be contiguous fp32")
    bind = binding.bind_output if output else binding.bind_input  # type: ignore[attr-defined]
    bind(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)


def compose_stage(
    stage: StageSpec, files: Mapping[str, Path]
) -> Iterator[tuple[int, int, ComposedPiece]]:
    """The stage's composed pieces ([first, stop) in its program, and the model), from the
    rank's segment files, read without their weights' bytes (``light_model``): the models
    point at the weights in the rank's files."""
    program = stage.program
    reads = _segment_reads(program, files)
    for first, stop in piece_spans(program):
        ops = [op for op in program[first:stop] if isinstance(op, RunOp | AttentionOp)]
        models = {op.file: light_model(files[op.file]) for op in ops if isinstance(op, RunOp)}
        yield first, stop, compose_piece(ops, models, _read_after(stage, stop, reads))
        del models


def _segment_reads(program: Sequence[ProgramOp], files: Mapping[str, Path]) -> dict[str, set[str]]:
    """What each segment reads (its graph inputs)."""
    return {op.file: set(graph_inputs(files[op.file])) for op in program if isinstance(op, RunOp)}


def _read_after(stage: StageSpec, stop: int, reads: Mapping[str, set[str]]) -> set[str]:
    """Names that ops from ``stop`` on, or the stage's outputs, read."""
    names = set(stage.outputs)
    for op in stage.program[stop:]:
        if isinstance(op, AttentionOp):
            names.update((op.q, op.k, op.v))
        elif isinstance(op, RunOp):
            names.update(reads[op.file])
        else:
            names.add(op.input)
    return names


@dataclass(frozen=True)
class ComposedRank:
    """A rank's composed pieces (by the program index of their first op) and the runners
    of the segments they hold (file -> runner over the piece's session)."""

    pieces: dict[int, Piece]
    runners: dict[str, OrtSegment]


def open_pieces(
    stage: StageSpec,
    files: Mapping[str, Path],
    options: Callable[[], ort.SessionOptions],
    *,
    run_in_thread: bool = True,
) -> ComposedRank:
    """Compose the stage's pieces from the rank's verified ``files`` and open one session
    each (``options`` makes each one's session options)."""
    pieces: dict[int, Piece] = {}
    for first, stop, composed in compose_stage(stage, files):
        piece_options = options()
        folder = files[composed.segments[0]].parent
        piece_options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(folder))
        # onnxruntime warns once per input that has a default (all of them, by design)
        piece_options.log_severity_level = max(piece_options.log_severity_level, QUIET)
        model = composed.model.SerializeToString()
        session = ort.InferenceSession(model, piece_options, providers=["CPUExecutionProvider"])
        pieces[first] = Piece(first, stop, composed, session, run_in_thread)
    runners = {
        file: piece.segment(file) for piece in pieces.values() for file in piece.composed.segments
    }
    return ComposedRank(pieces, runners)
