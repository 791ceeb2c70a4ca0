"""The generation floor: the unsliced model (an export at rank 1) in one process, run as
the agent runs it (the stage program, onnxruntime with one thread, the runtime's KV cache
and attention op) by a greedy loop with no serving layer at all.

    python -m benchmarks.gen_floor --repo REPO --model NAME --input-len 128 \
        --output-len 128 --batch 1 --requests 3

``--batch 1`` times one sequence at a time; ``--batch 32`` a static batch: 32 prompts
prefilled in one packed step, then 32 decode rows per step. Each token's time is taken
when its step returns, so the figures are the ones the streaming client computes for the
mesh (``gen_metrics``). Prints one JSON line: the summary and the process's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.gen_client import random_prompts
from benchmarks.gen_metrics import Trace, summarize_traces
from shardserve.process.heap import keep_freed_memory
from shardserve.repo.repository import GroupConfig, RunOp, load_group, verify_rank_files
from shardserve.runtime.attention import StepAttention, StepLayout
from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.kv_shape import cache_shape
from shardserve.runtime.pieces import ComposedRank, open_pieces
from shardserve.runtime.program import GatherCollective, OrtSegment, SegmentRunner, run_stage

Span = tuple[int, int, int]  # (sequence id, start position, tokens)


def one_thread_session(path: Path) -> ort.InferenceSession:
    """An onnxruntime session on one intra-op thread: what ``shardserve up --threads 1``
    gives each rank."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class _OneRank(GatherCollective):
    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        return [array]


class FloorModel:
    """The rank-1 group's one stage with its sessions and a KV cache."""

    def __init__(
        self,
        repo: Path,
        model: str,
        kv_bytes: int,
        make_session: Callable[[Path], ort.InferenceSession] = one_thread_session,
        piece_options: Callable[[], ort.SessionOptions] | None = None,
    ) -> None:
        """``piece_options``: run the stage's composed pieces (the agent's ``--fused``),
        each a session made with these options; else one session per segment."""
        self.group: GroupConfig = load_group(repo, model, 1)
        if self.group.rank_size != 1:
            raise SystemExit(f"the floor runs the unsliced model (rank 1), not {repo}")
        [self.stage] = self.group.stages
        files = verify_rank_files(repo, self.group, 0)
        runs = {op.file for op in self.stage.program if isinstance(op, RunOp)}
        composed = ComposedRank({}, {})
        if piece_options is not None:
            composed = open_pieces(self.stage, files, piece_options, run_in_thread=False)
        self.pieces = composed.pieces
        self.runners: dict[str, SegmentRunner] = {
            name: composed.runners.get(name) or OrtSegment(make_session(path), False)
            for name, path in files.items()
            if name in runs
        }
        self.cache = KVCache(cache_shape(self.group, 0), kv_bytes)

    def step(self, spans: list[Span], ids: list[int]) -> list[int]:
        """One packed step; the greedy next token of every span (its last row's logits)."""
        ends = np.cumsum([n for _, _, n in spans]) - 1
        positions = np.concatenate([np.arange(s, s + n) for _, s, n in spans])
        inputs = {
            "input_ids": np.asarray(ids, np.int64),
            "positions": positions.astype(np.int64),
            "logit_rows": ends.astype(np.int64),
        }
        attention = StepAttention(self.cache, StepLayout(spans))
        outputs = asyncio.run(
            run_stage(
                self.stage,
                self.runners,
                inputs,
                _OneRank(),
                attention=attention,
                pieces=self.pieces,
            )
        )
        return [int(v) for v in np.argmax(outputs["logits"], axis=-1)]


def generate_batch(
    model: FloorModel, prompts: list[list[int]], output_len: int, first_id: int
) -> tuple[list[Trace], list[list[int]]]:
    """Greedy generation of one static batch: one trace and the generated ids per sequence."""
    ids = list(range(first_id, first_id + len(prompts)))
    for seq_id, prompt in zip(ids, prompts, strict=True):
        model.cache.reserve(seq_id, len(prompt) + output_len)
    traces = [Trace(sent=time.perf_counter(), prompt_tokens=len(p)) for p in prompts]
    spans = [(seq_id, 0, len(p)) for seq_id, p in zip(ids, prompts, strict=True)]
    tokens = model.step(spans, [t for p in prompts for t in p])
    generated = [[t] for t in tokens]
    lengths = [len(p) for p in prompts]
    for _ in range(output_len - 1):
        _took(traces, time.perf_counter())
        spans = [(seq_id, n, 1) for seq_id, n in zip(ids, lengths, strict=True)]
        lengths = [n + 1 for n in lengths]
        tokens = model.step(spans, tokens)
        for sequence, token in zip(generated, tokens, strict=True):
            sequence.append(token)
    finished = time.perf_counter()
    _took(traces, finished)
    for trace in traces:
        trace.done, trace.output_tokens = finished, output_len
    for seq_id in ids:
        model.cache.free(seq_id)
    return traces, generated


def _took(traces: list[Trace], now: float) -> None:
    for trace in traces:
        trace.chunk_times.append(now)


def measure(args: argparse.Namespace) -> dict[str, object]:
    kv_bytes = (args.input_len + args.output_len) * args.batch * 2**20  # ample
    model = FloorModel(args.repo, args.model, kv_bytes)
    total = args.batch * (args.requests + 1)
    prompts = random_prompts(total, args.input_len, args.seed)
    generate_batch(model, prompts[: args.batch], args.output_len, 0)  # warm-up
    traces: list[Trace] = []
    for index in range(1, args.requests + 1):
        batch = prompts[index * args.batch : (index + 1) * args.batch]
        traces += generate_batch(model, batch, args.output_len, index * args.batch)[0]
    summary = summarize_traces(traces)
    summary["rss_mb"] = round(_rss_bytes() / 2**20, 1)
    summary["kv_bytes_per_token"] = model.cache.bytes_per_token
    return summary


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--requests", type=int, default=3, help="measured batches")
    parser.add_argument("--seed", type=int, default=0)
    keep_freed_memory()
    print(json.dumps(measure(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
