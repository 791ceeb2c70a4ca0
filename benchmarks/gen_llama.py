"""The llama.cpp peer: GGUF files of a benchmark checkpoint and ``llama-server`` on them.

- F32 and Q8_0 are written by the converter shipped in llama-cpp-python's sdist
  (``gguf_convert`` in the torch env), Q4_0 by its ``llama-quantize`` from the F32 file
  (default mix: llama.cpp keeps ``output.weight`` at Q6_K for Q4_0, as a user gets it);
- ``llama-server -m X.gguf -t T --parallel 32 -c 32 x (prompt + output + margin)``:
  continuous batching over 32 slots, measured by the same streaming client as the mesh
  (its ``/v1/completions`` takes token-id prompts, greedy, ``ignore_eos``).

GGUF files are cached under ``<cache>/gguf-<fixture hash>-<llama.cpp version>``.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import gen_llama_build, gen_models
from benchmarks.gen_client import GenLoad, run_gen_load
from benchmarks.gen_metrics import summarize_traces
from benchmarks.gguf_header import GGUFHeader, read_header
from benchmarks.meshes import Process
from shardserve.ops.child_mesh import free_port, rss_bytes

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("F32", "Q8_0", "Q4_0")
CONVERTER_TYPES = {"F32": "f32", "Q8_0": "q8_0"}
SLOTS = 32
SLOT_MARGIN = 64  # tokens per slot past prompt + output


def gguf_folder() -> Path:
    version = gen_llama_build.version_of(gen_llama_build.sdist())
    key = gen_models.source_hash(gen_models.FIXTURE_SCRIPT)
    return gen_models.cache_root() / f"gguf-{key}-{version}"


def gguf_file(model: str, precision: str) -> Path:
    """``<model>-<precision>.gguf``, made when missing."""
    path = gguf_folder() / f"{model}-{precision}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".partial")
    print(f"  writing {path.name}", flush=True)
    if precision in CONVERTER_TYPES:
        _convert(model, CONVERTER_TYPES[precision], scratch)
    elif precision == "Q4_0":
        quantize_q4_0(gguf_file(model, "F32"), scratch)
    else:
        raise ValueError(f"no GGUF precision {precision!r}; known: {', '.join(PRECISIONS)}")
    scratch.rename(path)
    return path


def _convert(model: str, outtype: str, out: Path) -> None:
    convert_checkpoint(gen_models.checkpoints() / model, outtype, out)


def convert_checkpoint(checkpoint: Path, outtype: str, out: Path) -> None:
    """llama.cpp's converter on a Hugging Face checkpoint folder (in the torch env)."""
    command = [str(gen_models.torch_python()), "-P", str(ROOT / "benchmarks" / "gguf_convert.py")]
    command += [str(gen_llama_build.source()), str(checkpoint)]
    command += ["--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed ({done.returncode}): {done.stderr[-1500:]}")


def quantize_q4_0(f32: Path, out: Path) -> None:
    """``llama-quantize F32 OUT Q4_0`` with its default mix (as a user gets it)."""
    quantize = gen_llama_build.binaries() / "llama-quantize"
    subprocess.run(
        [str(quantize), str(f32), str(out), "Q4_0", "2"], check=True, capture_output=True
    )


def header(path: Path) -> GGUFHeader:
    with path.open("rb") as stream:
        return read_header(stream, path.stat().st_size)


def server_argv(gguf: Path, threads: int, tokens_per_slot: int, port: int) -> list[str]:
    server = gen_llama_build.binaries() / "llama-server"
    argv = [str(server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads)]
    argv += ["--parallel", str(SLOTS), "-c", str(SLOTS * tokens_per_slot)]
    return [*argv, "--host", "127.0.0.1", "--port", str(port), "--no-webui"]


@contextmanager
def running_server(
    gguf: Path, threads: int, tokens_per_slot: int, log: Path
) -> Iterator[tuple[str, Process]]:
    """``llama-server`` on a free port until the block ends: (base URL, process)."""
    port = free_port()
    argv = server_argv(gguf, threads, tokens_per_slot + SLOT_MARGIN, port)
    process = Process(argv, {}, log)
    process.start()
    try:
        process.wait_http_ready(f"http://127.0.0.1:{port}/health", 300.0)
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.stop()


def measure_loads(
    gguf: Path, threads: int, loads: Sequence[GenLoad], log: Path, model: str
) -> tuple[dict[str, dict[str, Any]], float]:
    """Each load's summary (by its label) on ``llama-server`` over ``gguf``, and the
    server's RSS in MiB after them."""
    tokens = max(load.input_len + load.output_len for load in loads)
    summaries = {}
    with running_server(gguf, threads, tokens, log) as (url, server):
        for load in loads:
            # llama-server dropped a reused keep-alive connection now and then
            # (ServerDisconnectedError): a connection per request, as vLLM's client
            traces = asyncio.run(run_gen_load(url, model, load, fresh_connections=True))
            summaries[load.label] = summarize_traces(traces)
        rss = round(rss_bytes(server.pid) / 2**20, 1)
    return summaries, rss
