"""Hugging Face decoder checkpoints (GPT-2, Llama, Mistral, Qwen2) exported as per-rank
slices with packed-token segments around per-rank KV-cache attention ops."""

from shardserve.tools.export.hf.config import SUPPORTED, DecoderConfig, load_config
from shardserve.tools.export.hf.export import export_hf

__all__ = ["SUPPORTED", "DecoderConfig", "export_hf", "load_config"]
