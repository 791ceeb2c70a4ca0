"""Where a rank's decode step goes, by onnxruntime's own profiler: the unsliced export of a
benchmark model run by the floor's loop (``gen_floor``: the agent's stage program, KV cache
and attention) with ``SessionOptions.enable_profiling``, one sequence and a static batch.

    python -m benchmarks.gen_ort_profile [--model bench-125m] [--threads 2] [--steps 16]
        [--quantize int8|int4] [--fused] [--repo REPO --name SERVABLE] [--batches 1 32]

Prints, per decode step, ms of each onnxruntime op type (summed over the step's segments),
the sessions' total, and the step's wall time: the rest is the Python between runs
(attention over the KV cache, sampling). Sessions run as the agents' do since the threads
change: ``--threads`` intra-op threads without spinning. ``--fused``: the composed pieces
the agent runs by default (a c1 step: one onnxruntime run per piece; ``If`` is then each
segment's own overhead, its kernels counted under their op types).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from benchmarks import gen_models
from benchmarks.gen_client import random_prompts
from benchmarks.gen_floor import FloorModel
from shardserve.runtime.thread_pools import set_threads


def op_totals_ms(events: list[dict[str, Any]]) -> dict[str, float]:
    """ms per op type over a profile's kernel events (``cat`` Node, ``*_kernel_time``). An
    ``If`` (a composed piece's segment) counts its own time only: the kernels of its branch
    are events of their own, inside its span (Ifs are not nested in our pieces)."""
    kernels = [
        e
        for e in events
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")
    ]
    leaves = sorted(
        (int(e.get("ts", 0)), float(e.get("dur", 0))) for e in kernels if _op(e) != "If"
    )
    starts = [ts for ts, _ in leaves]
    sums = list(itertools.accumulate((dur for _, dur in leaves), initial=0.0))
    totals: dict[str, float] = defaultdict(float)
    for event in kernels:
        dur = float(event.get("dur", 0))
        if _op(event) == "If":
            begin = int(event.get("ts", 0))
            end = begin + int(dur)
            dur -= sums[bisect.bisect_right(starts, end)] - sums[bisect.bisect_left(starts, begin)]
        totals[_op(event)] += dur / 1000.0
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _op(event: dict[str, Any]) -> str:
    return str((event.get("args") or {}).get("op_name", "?"))


class ProfiledSessions:
    """Sessions made with profiling on; their profiles read back when the run ends."""

    def __init__(self, threads: int, prefix: Path | None) -> None:
        self.threads, self.prefix = threads, prefix  # prefix None: not profiled
        self.sessions: list[ort.InferenceSession] = []

    def __call__(self, path: Path) -> ort.InferenceSession:
        options = self.options(path.stem)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.sessions.append(session)
        return session

    def options(self, name: str = "piece") -> ort.SessionOptions:
        """A session's options (a composed piece's: its session is ``adopt``-ed after)."""
        options = ort.SessionOptions()
        set_threads(options, self.threads)  # as the agents' sessions
        if self.prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(self.prefix / f"{name}{len(self.sessions)}")
        return options

    def adopt(self, model: FloorModel) -> None:
        """The sessions of ``model``'s composed pieces, profiled like the others."""
        self.sessions += [piece.session for piece in model.pieces.values()]  # type: ignore[misc]

    def events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for session in self.sessions:
            found += json.loads(Path(session.end_profiling()).read_text())
        return found


@dataclass(frozen=True)
class Target:
    """What is profiled: a model repository's servable, run whole per piece or not."""

    repo: Path
    name: str
    fused: bool


def _model(target: Target, kv_bytes: int, sessions: ProfiledSessions) -> FloorModel:
    options = sessions.options if target.fused else None
    model = FloorModel(target.repo, target.name, kv_bytes, sessions, piece_options=options)
    sessions.adopt(model)
    return model


def profile(target: Target, threads: int, batch: int, steps: int, work: Path) -> dict[str, Any]:
    """One prefill of ``batch`` 128-token prompts, then ``steps`` decode steps profiled."""
    prefill = _model(target, 2**30, ProfiledSessions(threads, None))
    prompts = random_prompts(batch, 128, 0)
    for seq_id, prompt in enumerate(prompts):
        prefill.cache.reserve(seq_id, len(prompt) + steps + 1)
    spans = [(seq_id, 0, len(p)) for seq_id, p in enumerate(prompts)]
    tokens = prefill.step(spans, [t for p in prompts for t in p])
    # the decode steps on sessions of their own, profiled from their start, over the same
    # KV cache (the prefill's profile would drown a decode step's)
    sessions = ProfiledSessions(threads, work)
    model = _model(target, 1, sessions)
    model.cache = prefill.cache
    started = time.perf_counter()
    for step in range(steps):
        spans = [(seq_id, 128 + step, 1) for seq_id in range(batch)]
        tokens = model.step(spans, tokens)
    wall_ms = (time.perf_counter() - started) * 1000 / steps
    per_step = {op: round(ms / steps, 3) for op, ms in op_totals_ms(sessions.events()).items()}
    return {
        "servable": target.name,
        "fused": target.fused,
        "batch": batch,
        "threads": threads,
        "step_wall_ms": round(wall_ms, 3),
        "onnxruntime_ms": round(sum(per_step.values()), 3),
        "by_op_ms": per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-125m", choices=gen_models.BENCH_MODELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--quantize", choices=["int8", "int4"], help="the model's slices")
    parser.add_argument("--fused", action="store_true", help="composed pieces (the agent's)")
    parser.add_argument("--repo", type=Path, help="profile this repository's servable...")
    parser.add_argument("--name", help="...of this name instead of a benchmark model")
    args = parser.parse_args()
    import tempfile

    if args.repo is not None:
        target = Target(args.repo, args.name or args.model, args.fused)
    else:
        target = Target(
            gen_models.exported(args.model, 1, 1, args.quantize), args.model, args.fused
        )

    for batch in args.batches:
        with tempfile.TemporaryDirectory(prefix="ort-profile-") as work:
            found = profile(target, args.threads, batch, args.steps, Path(work))
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
