"""onnxruntime's thread pools as a rank uses them: its own count, and no spinning.

A rank runs one session per segment of its slice, one after another, with numpy attention
and collectives between them; every session owns an intra-op pool of ``threads - 1``
workers. By default onnxruntime's workers spin on a core while they wait for work, so a
13-segment slice at ``--threads 2`` kept 13 workers spinning on 2 cores, and the
collectives, the broker and the next segment waited behind them (125 M Llama, 2 cores:
ITL 152 ms against 19.5 ms at one thread). With spinning off a waiting worker sleeps: the
same rank at ``--threads 2`` made ITL 14.3 ms. Spinning is a run-time option, not a graph
rewrite, so it is not part of the compile cache's key; the thread count stays in it.
"""

from __future__ import annotations

import onnxruntime as ort

# Both pools: inter-op is idle under ORT_SEQUENTIAL, but a spinning pool would still spin.
NO_SPINNING = (
    ("session.intra_op.allow_spinning", "0"),
    ("session.inter_op.allow_spinning", "0"),
)


def set_threads(options: ort.SessionOptions, intra_op: int, inter_op: int = 1) -> None:
    """Give ``options`` its pools' sizes, with workers that sleep instead of spinning."""
    options.intra_op_num_threads = intra_op
    options.inter_op_num_threads = inter_op
    for key, value in NO_SPINNING:
        options.add_session_config_entry(key, value)
