"""A GGUF file's metadata read into the exporter's ``DecoderConfig``, for the architectures
llama.cpp writes for Llama, Mistral (``llama`` too) and Qwen2; anything else is refused."""

from __future__ import annotations

from shardserve.errors import ExportError
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.hf.config import DecoderConfig

__all__ = ["ARCHITECTURES", "decoder_config"]

# general.architecture -> the transformers class the same weights make. llama.cpp writes
# Mistral checkpoints as "llama"; the file's name tells them apart (as transformers does).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def decoder_config(file: GgufFile) -> DecoderConfig:
    arch = file.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise ExportError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))} (Llama, Mistral and Qwen2 files)"
        )
    _refuse_rope_scaling(file, arch)
    hidden = file.positive(f"{arch}.embedding_length")
    heads = file.positive(f"{arch}.attention.head_count")
    kv_heads = file.positive(f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ExportError(f"GGUF: {heads} heads cannot share {kv_heads} key/value heads")
    qwen = arch == "qwen2"
    return DecoderConfig(
        architecture=_class_name(file, arch),
        family="llama",
        layers=file.positive(f"{arch}.block_count"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=file.positive(f"{arch}.attention.key_length", hidden // heads),
        intermediate=file.positive(f"{arch}.feed_forward_length"),
        vocab=_vocab(file, arch),
        max_positions=context_limit(file, arch),
        norm_eps=float(file.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        activation="silu",
        tied_head="output.weight" not in file.tensors,
        qkv_bias=qwen or "blk.0.attn_q.bias" in file.tensors,
        o_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias=False,
        rope_theta=float(file.get(f"{arch}.rope.freq_base", 10000.0)),
        eos_token_ids=file.eos_ids(),
    )


def context_limit(file: GgufFile, arch: str) -> int:
    """The context limit; a sliding window, when the file states one, caps it, so the
    full attention we run stays exact (as the HF exporter does for Mistral)."""
    limit = file.positive(f"{arch}.context_length")
    window = file.get(f"{arch}.attention.sliding_window")
    if window is None:
        return limit
    return min(limit, file.positive(f"{arch}.attention.sliding_window"))


def _class_name(file: GgufFile, arch: str) -> str:
    name = str(file.get("general.name", "")).lower()
    return "MistralForCausalLM" if arch == "llama" and "mistral" in name else ARCHITECTURES[arch]


def _refuse_rope_scaling(file: GgufFile, arch: str) -> None:
    scaling = file.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ExportError(f"GGUF rope scaling {scaling!r} is not supported (plain RoPE only)")
    rotary = file.get(f"{arch}.rope.dimension_count")
    head_dim = file.get(f"{arch}.attention.key_length") or (
        file.positive(f"{arch}.embedding_length") // file.positive(f"{arch}.attention.head_count")
    )
    if rotary is not None and rotary != head_dim:
        raise ExportError(f"GGUF partial rotary ({rotary} of {head_dim} dims) is not supported")


def _vocab(file: GgufFile, arch: str) -> int:
    """The embedding's rows: what the weights hold (the metadata key is optional)."""
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ExportError(f"GGUF file {file.path.name} has no tensor 'token_embd.weight'")
    rows = int(embedding.shape[-1])  # GGUF shapes list the fastest-varying dimension first
    stated = file.get(f"{arch}.vocab_size", rows)
    if stated != rows:
        raise ExportError(f"GGUF: {arch}.vocab_size {stated} but token_embd has {rows} rows")
    return rows
