"""What the model itself allows on this machine: onnxruntime in-process, no serving layer.

The batching and pipelining targets compare the mesh with itself (batched vs unbatched,
pipelined vs one request in flight). How far either can go is set first by the model and
the machine, so each scenario also measures its ceiling in the same run:

- batching: rows/s of one session (one intra-op thread, like an agent) fed 32-row batches
  vs 1-row batches. A GEMV streams every weight once per row; a 32-row GEMM reuses them.
- pipelining: rows/s of two sessions, one per stage slice, each on its own thread at the
  same time (onnxruntime releases the GIL) vs the two run one after the other. Two cores
  running two memory-bound stages share one memory bus, so this can stay well under 2x.
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


def batching_ceiling(model: Path, batch_rows: int, seconds: float) -> dict[str, float]:
    """Rows/s of the model at 1 row per run and at ``batch_rows`` rows per run."""
    session = single_thread_session(model)
    single = _rows_per_second([(session, _feed(session, 1))], seconds)
    batched = _rows_per_second([(session, _feed(session, batch_rows))], seconds)
    return {"rows_per_s_1": single, f"rows_per_s_{batch_rows}": batched, "ratio": batched / single}


def pipeline_ceiling(stages: list[Path], seconds: float) -> dict[str, float]:
    """Rows/s (1 row per run) of the stage slices run one after the other vs all at once,
    each on its own thread; the concurrent figure is the slowest stage's rate."""
    runs = [(s, _feed(s, 1)) for s in map(single_thread_session, stages)]
    serial = _rows_per_second(runs, seconds)
    rates = [0.0] * len(runs)

    def loop(index: int) -> None:
        rates[index] = _rows_per_second([runs[index]], seconds)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    concurrent = min(rates)
    return {
        "rows_per_s_serial": serial,
        "rows_per_s_concurrent": concurrent,
        "ratio": concurrent / serial,
    }
