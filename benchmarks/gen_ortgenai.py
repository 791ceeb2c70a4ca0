"""The onnxruntime-genai peer: its model builder's export of a benchmark checkpoint, run
by an in-process greedy loop (no server: its figures are the runtime's own).

Runs in the benchmark's torch environment, where onnxruntime-genai is installed; imports
neither shardserve nor the benchmarks package.

    TORCH_PYTHON -P benchmarks/gen_ortgenai.py build --checkpoint CKPT --out DIR
    TORCH_PYTHON -P benchmarks/gen_ortgenai.py run --model DIR --prompts P.json \
        --output-len 128 --batch 1 --threads 2 [--profile PREFIX]

``run`` takes the prompts (token ids, the benchmark client's) from a JSON file; with
``--batch 1`` it generates them one after another, with ``--batch 32`` as one static batch
(after a short warm-up generation). A token's time is when ``generate_next_token``
returns it. Prints one JSON line: each sequence's times (the parent's ``gen_metrics``
summarizes them) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

WARMUP_SEQUENCES, WARMUP_TOKENS = 2, 4


def build(checkpoint: Path, out: Path) -> None:
    """``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e cpu``."""
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint)]
    command += ["-o", str(scratch), "-p", "fp32", "-e", "cpu", "-c", str(scratch / "cache")]
    subprocess.run(command, check=True)
    shutil.rmtree(scratch / "cache", ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)


def set_session_options(folder: Path, threads: int, profile: str | None) -> None:
    """The builder's ``genai_config.json`` with ``threads`` intra-op threads (and the
    onnxruntime profiler when asked)."""
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    options.pop("enable_profiling", None)
    if profile:
        options["enable_profiling"] = profile
    path.write_text(json.dumps(config, indent=2))


def generate(og: Any, model: Any, prompts: list[list[int]], output_len: int) -> list[dict]:
    """One static batch, greedy, exactly ``output_len`` tokens each: every sequence's times."""
    params = og.GeneratorParams(model)
    length = len(prompts[0]) + output_len
    params.set_search_options(
        do_sample=False, max_length=length, min_length=length, batch_size=len(prompts)
    )
    sent = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompts, dtype=np.int32))
    times: list[float] = []
    while not generator.is_done() and len(times) < output_len:
        generator.generate_next_token()
        times.append(time.perf_counter())
    return [
        {
            "sent": sent,
            "chunk_times": times,
            "done": times[-1],
            "output_tokens": len(times),
            "prompt_tokens": len(p),
        }
        for p in prompts
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime_genai as og

    set_session_options(args.model, args.threads, args.profile)
    model = og.Model(str(args.model))
    prompts: list[list[int]] = json.loads(args.prompts.read_text())
    # warm-up: a few short sequences (a whole 32-batch prefill would cost as much as the run)
    generate(og, model, prompts[:WARMUP_SEQUENCES], WARMUP_TOKENS)
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    traces = [t for batch in batches for t in generate(og, model, batch, args.output_len)]
    return {
        "traces": traces,
        "rss_mb": round(_peak_rss_bytes() / 2**20, 1),
        "version": og.__version__,
    }


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build")
    make.add_argument("--checkpoint", type=Path, required=True)
    make.add_argument("--out", type=Path, required=True)
    measure = sub.add_parser("run")
    measure.add_argument("--model", type=Path, required=True)
    measure.add_argument("--prompts", type=Path, required=True)
    measure.add_argument("--output-len", type=int, required=True)
    measure.add_argument("--batch", type=int, default=1)
    measure.add_argument("--threads", type=int, default=2)
    measure.add_argument("--profile", default=None, help="onnxruntime profile file prefix")
    args = parser.parse_args()
    if args.command == "build":
        build(args.checkpoint, args.out)
    else:
        print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
