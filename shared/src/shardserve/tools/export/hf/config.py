"""A Hugging Face decoder's ``config.json`` (+ ``generation_config.json``) read into the few
numbers the exporter needs, for the architectures it supports; anything else is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shardserve.errors import ExportError

__all__ = ["SUPPORTED", "DecoderConfig", "load_config", "read_json"]

Family = Literal["gpt2", "llama"]

SUPPORTED: dict[str, Family] = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    family: Family
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    norm_eps: float
    activation: str
    tied_head: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float = 0.0  # 0 = no rotary (GPT-2 learns its positions)
    eos_token_ids: tuple[int, ...] = ()


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ExportError(f"checkpoint file {path} is missing") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object")
    return data


def load_config(folder: Path) -> DecoderConfig:
    """config.json of ``folder``, checked; EOS ids from generation_config.json when present."""
    raw = read_json(folder / "config.json")
    architecture = _architecture(raw)
    family = SUPPORTED[architecture]
    config = _gpt2(raw) if family == "gpt2" else _llama(raw, architecture)
    generation = folder / "generation_config.json"
    eos = read_json(generation).get("eos_token_id") if generation.is_file() else None
    eos = raw.get("eos_token_id") if eos is None else eos
    ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return DecoderConfig(architecture=architecture, family=family, eos_token_ids=ids, **config)


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    supported = ", ".join(sorted(SUPPORTED))
    if len(names) != 1 or names[0] not in SUPPORTED:
        raise ExportError(
            f"architecture {names or 'unset'} is not supported; supported: {supported}"
        )
    return str(names[0])


def _need(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value < 1:
        raise ExportError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _gpt2(raw: dict[str, Any]) -> dict[str, Any]:
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ExportError(f"GPT-2 activation {activation!r} is not supported ({GPT2_ACTIVATIONS})")
    if raw.get("scale_attn_by_inverse_layer_idx"):
        raise ExportError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
    hidden, heads = _need(raw, "n_embd"), _need(raw, "n_head")
    if hidden % heads:
        raise ExportError(f"config.json: n_embd {hidden} is not divisible by n_head {heads}")
    return dict(
        layers=_need(raw, "n_layer"),
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        intermediate=raw.get("n_inner") or 4 * hidden,
        vocab=_need(raw, "vocab_size"),
        max_positions=_need(raw, "n_positions"),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        activation=activation,
        tied_head=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    )


def _llama(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    if raw.get("rope_scaling"):
        raise ExportError(f"rope_scaling {raw['rope_scaling']!r} is not supported (plain RoPE)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ExportError(f"hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
    hidden, heads = _need(raw, "hidden_size"), _need(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ExportError(f"config.json: {heads} heads cannot share {kv_heads} key/value heads")
    qwen = architecture == "Qwen2ForCausalLM"
    return dict(
        layers=_need(raw, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate=_need(raw, "intermediate_size"),
        vocab=_need(raw, "vocab_size"),
        max_positions=_max_positions(raw, windowed_by_default=not qwen),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        activation="silu",
        tied_head=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qwen or bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)) and not qwen,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_theta=_rope_theta(raw),
    )


def _rope_theta(raw: dict[str, Any]) -> float:
    """``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (transformers 5)."""
    params = raw.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ExportError(f"rope_parameters {params!r} are not supported (plain RoPE only)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _max_positions(raw: dict[str, Any], windowed_by_default: bool) -> int:
    """Context limit; a sliding window caps it, so full attention stays exact (Qwen2 uses
    its window only when use_sliding_window says so, Mistral whenever it has one)."""
    limit = _need(raw, "max_position_embeddings")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", windowed_by_default)
    if isinstance(window, int) and window > 0 and uses_window:
        limit = min(limit, window)
    return limit
