"""The generation benchmark's models, made once and cached between runs.

- a throwaway virtual environment with torch (``torch-env``): torch is never a project
  dependency, but the checkpoints are made by transformers and the peer server runs it;
- the two Llama-shaped random checkpoints of ``tests/fixtures/hf/make_fixtures.py
  --bench-models`` (``bench-small``: hidden 256, 4 layers; ``bench-large``: hidden 1024,
  8 layers, 16/4 heads, vocabulary 32000, about 600 MB in fp32);
- their exports (``shardserve export hf``) per layout (rank size, stage size).

Checkpoints and exports live under a folder keyed by the fixture script's hash (exports
also by the exporter's source), so a changed script or exporter makes new ones. The cache
is ``$SHARDSERVE_BENCH_CACHE`` or ``~/.cache/shardserve-bench``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_SCRIPT = ROOT / "tests" / "fixtures" / "hf" / "make_fixtures.py"
EXPORTER = ROOT / "shared" / "src" / "shardserve" / "tools" / "export" / "hf"
QUANTIZER = ROOT / "shared" / "src" / "shardserve" / "tools" / "quantize"
# onnxruntime-genai (its model builder and runtime) and sentencepiece (imported by
# llama.cpp's GGUF converter) serve the peers; the converter's own ``gguf`` library comes
# from the llama.cpp sources (``gen_llama_build.gguf_py``).
TORCH_PACKAGES = (
    "torch==2.13.0",
    "transformers",
    "safetensors",
    "tokenizers",
    "numpy",
    "aiohttp",
    "onnxruntime-genai",
    "onnx",
    "onnx-ir",  # the model builder's
    "sentencepiece",
    "gguf",  # transformers reading the quality checkpoint's GGUF (make_quality_checkpoint)
    "protobuf",
    "accelerate",  # transformers loads a GGUF file only with it
)
BENCH_MODELS = ("bench-small", "bench-large", "bench-125m")


def cache_root() -> Path:
    configured = os.environ.get("SHARDSERVE_BENCH_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "shardserve-bench"


def source_hash(*paths: Path) -> str:
    """12 hex digits over the bytes of every .py file under ``paths`` (in name order)."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def torch_python() -> Path:
    """The torch environment's interpreter, created on first use (pip finds torch 2.13.0
    CPU as a local wheel); an unfinished environment is made again, and one made with
    another package list gets the packages it lacks."""
    env = cache_root() / "torch-env"
    python = env / "bin" / "python"
    ready, wanted = env / ".ready", "\n".join(TORCH_PACKAGES) + "\n"
    if ready.exists() and ready.read_text() == wanted:
        return python
    if not ready.exists():
        shutil.rmtree(env, ignore_errors=True)
        env.parent.mkdir(parents=True, exist_ok=True)
        print(f"  making the torch environment {env} (several minutes)", flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(env)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TORCH_PACKAGES], check=True)
    ready.write_text(wanted)
    return python


def checkpoints() -> Path:
    """The folder holding ``bench-small/`` and ``bench-large/`` (made when missing)."""
    folder = cache_root() / f"checkpoints-{source_hash(FIXTURE_SCRIPT)}"
    if all((folder / name / "config.json").exists() for name in BENCH_MODELS):
        return folder
    scratch = folder.with_name(folder.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"  making the benchmark checkpoints in {folder}", flush=True)
    command = [str(torch_python()), str(FIXTURE_SCRIPT), "--bench-models", str(scratch)]
    subprocess.run(command, check=True, cwd=ROOT)
    shutil.rmtree(folder, ignore_errors=True)
    scratch.rename(folder)
    return folder


def shardserve_cli() -> str:
    """This interpreter's ``shardserve`` command."""
    return str(Path(sys.executable).parent / "shardserve")


def exporter_quantizes() -> bool:
    """Whether ``shardserve export hf`` has ``--quantize`` (int8 / int4 slices)."""
    done = subprocess.run(
        [shardserve_cli(), "export", "hf", "--help"], capture_output=True, text=True
    )
    return "--quantize" in done.stdout


def exported(model: str, rank_size: int, stage_size: int, quantize: str | None = None) -> Path:
    """A model repository with ``model`` exported at this layout (version 1), its slices
    quantized (``--quantize int8|int4``) when ``quantize`` is given."""
    writers = [path for path in (EXPORTER, QUANTIZER) if path.exists()]
    key = f"{source_hash(FIXTURE_SCRIPT)}-{source_hash(*writers)}"
    suffix = f"-{quantize}" if quantize else ""
    repo = cache_root() / f"exports-{key}" / f"{model}-r{rank_size}-s{stage_size}{suffix}"
    if (repo / model / "1" / "group.json").exists():
        return repo
    command = [shardserve_cli(), "export", "hf", str(checkpoints() / model)]
    command += ["--rank-size", str(rank_size), "--stage-size", str(stage_size)]
    command += ["--out", str(repo), "--if-missing"]
    command += ["--quantize", quantize] if quantize else []
    print(f"  exporting {model} at {rank_size} rank(s), {stage_size} stage(s){suffix}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return repo
