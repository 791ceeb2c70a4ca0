"""``shardserve export gguf``: a llama.cpp GGUF file (Llama, Mistral, Qwen2) as per-rank
slices, through the Hugging Face exporter: the metadata becomes its ``DecoderConfig``, the
tensors are renamed and un-permuted, each linear weight is served at the precision its type
maps to (``precision``: fp32, or MatMulNBits blocks of 32 at int8/int4, Q8_0/Q4_0 kept
exactly) unless ``--quantize`` sets one for all (Q8_0/Q4_0 blocks of that precision still
kept), and the tokenizer is rebuilt from the metadata. The mapping is printed first."""

from __future__ import annotations

import functools
from pathlib import Path

from shardserve.repo.repository import GroupConfig
from shardserve.tools.common import Progress, report_progress
from shardserve.tools.export.gguf.config import decoder_config
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.gguf.precision import BLOCK, linear_weights, summary
from shardserve.tools.export.gguf.tensors import GgufTensors
from shardserve.tools.export.gguf.tokenizer import write_tokenizer
from shardserve.tools.export.hf.export import DecoderSource, export_decoder
from shardserve.tools.quantize import AS_SOURCE, DEFAULT_ACCURACY_LEVEL, FP32, QuantizeSpec

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
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
) -> GroupConfig:
    """Write ``gguf_file`` as servable ``name`` (default: from the file name) under ``out``:
    each linear weight at the precision its GGUF type maps to (``precision``; MatMulNBits at
    ``accuracy_level``), or, given ``quantize``, every one at that (the file's own Q8_0/Q4_0
    blocks kept where they are that format; ``fp32``: all dequantized)."""
    file = GgufFile(gguf_file)
    config = decoder_config(file)
    keep = quantize is not None and quantize.precision != FP32
    tensors = GgufTensors(file, config, progress, keep_blocks=keep, as_served=quantize is None)
    served = [(tensors.kind(n), tensors.served_bits(n)) for n in linear_weights(config)]
    if quantize is None and any(bits is not None for _, bits in served):
        quantize = QuantizeSpec(AS_SOURCE, BLOCK, accuracy_level)
    report_progress(progress, summary(served, quantize))
    source = DecoderSource(
        config=config,
        tensors=tensors,
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
