"""``shardserve export gguf``: a llama.cpp GGUF file (Llama, Mistral, Qwen2) as per-rank
slices, through the Hugging Face exporter: the metadata becomes its ``DecoderConfig``, the
tensors are renamed, un-permuted and dequantized to fp32 (with ``--quantize``, Q8_0/Q4_0
linear weights of that precision keep the file's blocks instead), and the tokenizer is
rebuilt from the metadata."""

from __future__ import annotations

import functools
from pathlib import Path

from shardserve.repo.repository import GroupConfig
from shardserve.tools.common import Progress
from shardserve.tools.export.gguf.config import decoder_config
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.gguf.tensors import GgufTensors
from shardserve.tools.export.gguf.tokenizer import write_tokenizer
from shardserve.tools.export.hf.export import DecoderSource, export_decoder
from shardserve.tools.quantize import QuantizeSpec

__all__ = ["default_name", "export_gguf"]


def default_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``: the file's stem
    without its quantization suffix, lower case."""
    stem = path.name.removesuffix(".gguf")
    base, _, suffix = stem.rpartition(".")
    return (base if base and suffix[:1].upper() in "QFB" else stem).lower()


def export_gguf(
    gguf_file: Path,
    out: Path,
    *,
    rank_size: int = 1,
    stage_size: int = 1,
    name: str | None = None,
    version: int = 1,
    overwrite: bool = False,
    progress: Progress | None = None,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write ``gguf_file`` as servable ``name`` (default: from the file name) under ``out``
    (its weights quantized per rank by ``quantize`` when given, the file's own Q8_0/Q4_0
    blocks kept where they are that format)."""
    file = GgufFile(gguf_file)
    config = decoder_config(file)
    source = DecoderSource(
        config=config,
        tensors=GgufTensors(file, config, progress, keep_blocks=quantize is not None),
        write_tokenizer=functools.partial(write_tokenizer, file),
        model="gguf",
    )
    return export_decoder(
        source,
        out,
        name=name or default_name(gguf_file),
        rank_size=rank_size,
        stage_size=stage_size,
        version=version,
        overwrite=overwrite,
        progress=progress,
        quantize=quantize,
    )
