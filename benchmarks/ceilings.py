"""The same ratios for the model alone: onnxruntime in-process, no serving layer.

The batching and pipelining targets compare the mesh with itself (batched vs unbatched,
pipelined vs one request in flight). Each scenario also measures, in the same run, the
ratio the model alone gives on this machine, the reference the mesh's ratio is read
against (keys ``*.ceiling``):

- batching: rows/s of one session (one intra-op thread, like an agent) fed 32-row batches
  vs 1-row batches. A GEMV streams every weight once per row; a 32-row GEMM reuses them.
  With the same per-request cost added to both, a serving layer's ratio is lower; it can
  only come closer by amortizing its own per-request costs in batches too.
- pipelining: rows/s of two sessions, one per stage slice, each on its own thread at the
  same time (onnxruntime releases the GIL) vs the two run one after the other. Stages whose
  weights together exceed the last-level cache slow each other down, so this can stay
  well under 2x. (The mesh's own ratio also overlaps its per-request latency, so it is
  not bounded by this one.)

Each figure is the best of two tries: the reference is the machine at its quietest.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def single_thread_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts)


def _feed(session: ort.InferenceSession, rows: int) -> dict[str, np.ndarray]:
    """Random FP32 rows for every input (the batch dimension first, the rest fixed)."""
    rng = np.random.default_rng(0)
    feed = {}
    for arg in session.get_inputs():
        tail = [d if isinstance(d, int) else 1 for d in arg.shape[1:]]
        feed[arg.name] = rng.standard_normal((rows, *tail), dtype=np.float32)
    return feed


def _rows_per_second(
    runs: list[tuple[ort.InferenceSession, dict[str, np.ndarray]]], seconds: float
) -> float:
    """Rows/s of running every (session, feed) of ``runs`` in turn, for ``seconds``."""
    rows = next(iter(runs[0][1].values())).shape[0]
    for session, feed in runs:
        session.run(None, feed)  # warm
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for session, feed in runs:
            session.run(None, feed)
        done += rows
    return done / (time.perf_counter() - began)


def batching_ceiling(
    model: Path, batch_rows: int, seconds: float, tries: int = 2
) -> dict[str, float]:
    """Rows/s of the model at 1 row per run and at ``batch_rows`` rows per run (the best
    of ``tries`` each)."""
    session = single_thread_session(model)
    one, many = _feed(session, 1), _feed(session, batch_rows)
    single = max(_rows_per_second([(session, one)], seconds) for _ in range(tries))
    batched = max(_rows_per_second([(session, many)], seconds) for _ in range(tries))
    return {"rows_per_s_1": single, f"rows_per_s_{batch_rows}": batched, "ratio": batched / single}


def pipeline_ceiling(stages: list[Path], seconds: float, tries: int = 2) -> dict[str, float]:
    """Rows/s (1 row per run) of the stage slices run one after the other vs all at once,
    each on its own thread (the slowest stage's rate); the best of ``tries`` each."""
    runs = [(s, _feed(s, 1)) for s in map(single_thread_session, stages)]
    serial = max(_rows_per_second(runs, seconds) for _ in range(tries))
    concurrent = max(_concurrent_rows_per_second(runs, seconds) for _ in range(tries))
    return {
        "rows_per_s_serial": serial,
        "rows_per_s_concurrent": concurrent,
        "ratio": concurrent / serial,
    }


def _concurrent_rows_per_second(
    runs: list[tuple[ort.InferenceSession, dict[str, np.ndarray]]], seconds: float
) -> float:
    """Every (session, feed) on its own thread at once: the slowest one's rows/s."""
    rates = [0.0] * len(runs)

    def loop(index: int) -> None:
        rates[index] = _rows_per_second([runs[index]], seconds)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return min(rates)
