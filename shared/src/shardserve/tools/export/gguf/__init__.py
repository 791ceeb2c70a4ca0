"""llama.cpp GGUF files (Llama, Mistral, Qwen2) exported through the Hugging Face
exporter: metadata to config, tensors renamed and dequantized, tokenizer rebuilt."""

from shardserve.tools.export.gguf.export import default_name, export_gguf

__all__ = ["default_name", "export_gguf"]
