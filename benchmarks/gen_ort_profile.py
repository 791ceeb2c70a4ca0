"""Where a rank's decode step goes, by onnxruntime's own profiler: the unsliced export of a
benchmark model run by the floor's loop (``gen_floor``: the agent's stage program, KV cache
and attention) with ``SessionOptions.enable_profiling``, one sequence and a static batch.

    python -m benchmarks.gen_ort_profile [--model bench-125m] [--threads 2] [--steps 16]

Prints, per decode step, ms of each onnxruntime op type (summed over the step's segments),
the sessions' total, and the step's wall time: the rest is the Python between runs
(attention over the KV cache, sampling). Sessions run as the agents' do since the threads
change: ``--threads`` intra-op threads without spinning.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import onnxruntime as ort

from benchmarks import gen_models
from benchmarks.gen_client import random_prompts
from benchmarks.gen_floor import FloorModel


def op_totals_ms(events: list[dict[str, Any]]) -> dict[str, float]:
    """ms per op type over a profile's kernel events (``cat`` Node, ``*_kernel_time``)."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
            op = str((event.get("args") or {}).get("op_name", "?"))
            totals[op] += float(event.get("dur", 0)) / 1000.0
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


class ProfiledSessions:
    """Sessions made with profiling on; their profiles read back when the run ends."""

    def __init__(self, threads: int, prefix: Path | None) -> None:
        self.threads, self.prefix = threads, prefix  # prefix None: not profiled
        self.sessions: list[ort.InferenceSession] = []

    def __call__(self, path: Path) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(self.prefix / path.stem)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.sessions.append(session)
        return session

    def events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for session in self.sessions:
            found += json.loads(Path(session.end_profiling()).read_text())
        return found


def profile(model_name: str, threads: int, batch: int, steps: int, work: Path) -> dict[str, Any]:
    """One prefill of ``batch`` 128-token prompts, then ``steps`` decode steps profiled."""
    repo = gen_models.exported(model_name, 1, 1)
    prefill = FloorModel(repo, model_name, 2**30, make_session=ProfiledSessions(threads, None))
    prompts = random_prompts(batch, 128, 0)
    for seq_id, prompt in enumerate(prompts):
        prefill.cache.reserve(seq_id, len(prompt) + steps + 1)
    spans = [(seq_id, 0, len(p)) for seq_id, p in enumerate(prompts)]
    tokens = prefill.step(spans, [t for p in prompts for t in p])
    # the decode steps on sessions of their own, profiled from their start, over the same
    # KV cache (the prefill's profile would drown a decode step's)
    sessions = ProfiledSessions(threads, work)
    model = FloorModel(repo, model_name, 1, make_session=sessions)
    model.cache = prefill.cache
    started = time.perf_counter()
    for step in range(steps):
        spans = [(seq_id, 128 + step, 1) for seq_id in range(batch)]
        tokens = model.step(spans, tokens)
    wall_ms = (time.perf_counter() - started) * 1000 / steps
    per_step = {op: round(ms / steps, 3) for op, ms in op_totals_ms(sessions.events()).items()}
    return {
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
    args = parser.parse_args()
    import tempfile

    for batch in args.batches:
        with tempfile.TemporaryDirectory(prefix="ort-profile-") as work:
            found = profile(args.model, args.threads, batch, args.steps, Path(work))
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
