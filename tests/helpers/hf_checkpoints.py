"""Tiny random Hugging Face checkpoints written with numpy + safetensors (no torch), and a
float64 numpy forward of the same models to check the export against.

Kinds: ``gpt2`` (Conv1D layout, fused c_attn, tied head, vocab 250: split over 2 ranks,
replicated over 4), ``llama`` (GQA 4 heads / 2 KV heads, untied, 4 layers, two shards
with an index), ``qwen2`` (q/k/v biases, tied, one KV head: replicated over ranks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama" / "tokenizer.json"

Weights = dict[str, np.ndarray]

CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 3,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 250,
        "n_positions": 64,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "eos_token_id": 249,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": 2,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "eos_token_id": [3, 4],
    },
}


def weight_shapes(kind: str) -> dict[str, tuple[int, ...]]:
    c = CONFIGS[kind]
    if kind == "gpt2":
        h, v, i = c["n_embd"], c["vocab_size"], 4 * c["n_embd"]
        shapes = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (c["n_positions"], h)}
        for layer in range(c["n_layer"]):
            b = f"transformer.h.{layer}."
            shapes |= {f"{b}ln_1.weight": (h,), f"{b}ln_1.bias": (h,)}
            shapes |= {f"{b}attn.c_attn.weight": (h, 3 * h), f"{b}attn.c_attn.bias": (3 * h,)}
            shapes |= {f"{b}attn.c_proj.weight": (h, h), f"{b}attn.c_proj.bias": (h,)}
            shapes |= {f"{b}ln_2.weight": (h,), f"{b}ln_2.bias": (h,)}
            shapes |= {f"{b}mlp.c_fc.weight": (h, i), f"{b}mlp.c_fc.bias": (i,)}
            shapes |= {f"{b}mlp.c_proj.weight": (i, h), f"{b}mlp.c_proj.bias": (h,)}
        return shapes | {"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(c["num_hidden_layers"]):
        b = f"model.layers.{layer}."
        shapes |= {f"{b}input_layernorm.weight": (h,), f"{b}post_attention_layernorm.weight": (h,)}
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{b}self_attn.{name}.weight"] = (out, h)
            if kind == "qwen2":
                shapes[f"{b}self_attn.{name}.bias"] = (out,)
        shapes[f"{b}self_attn.o_proj.weight"] = (h, q)
        shapes |= {f"{b}mlp.gate_proj.weight": (i, h), f"{b}mlp.up_proj.weight": (i, h)}
        shapes[f"{b}mlp.down_proj.weight"] = (h, i)
    return shapes


def random_weights(kind: str, seed: int = 0) -> Weights:
    """Normals x 0.08 (norm gains around 1): clear top-1 margins for greedy decoding."""
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for name, shape in weight_shapes(kind).items():
        value = rng.standard_normal(shape) * 0.08
        if "ln" in name.split(".")[-2] or "norm" in name:
            value = 1.0 + value if name.endswith("weight") else value
        weights[name] = value.astype(np.float32)
    return weights


def write_checkpoint(
    folder: Path, kind: str, weights: Weights, shards: int = 1, dtype: Any = np.float32
) -> Path:
    """config.json, generation_config.json, the llama fixture's tokenizer.json, and the
    tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[kind]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"]})
    )
    shutil.copyfile(TOKENIZER, folder / "tokenizer.json")  # any usable one: export checks
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].astype(dtype) for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index::shards]
        save_file({n: weights[n].astype(dtype) for n in part}, str(folder / file))
        weight_map |= {n: file for n in part}
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return folder


# ---------------------------------------------------------------- numpy reference forward


def reference_logits(
    kind: str,
    weights: Weights,
    ids: list[int],
    head: np.ndarray | None = None,
    config: dict[str, Any] | None = None,
) -> np.ndarray:
    """Logits [T, V] of the whole sequence ``ids``, float64, no cache; ``head`` [V, H]
    replaces the LM head (a tied head's quantized copy, the embedding staying as it is);
    ``config`` replaces ``CONFIGS[kind]`` (a Llama-family model from elsewhere)."""
    w = {n: a.astype(np.float64) for n, a in weights.items()}
    hidden = _gpt2(w, ids) if kind == "gpt2" else _llama(kind, w, ids, config)
    return hidden @ (default_head(kind, w) if head is None else head.astype(np.float64)).T


def default_head(kind: str, w: Weights) -> np.ndarray:
    """The LM head [V, H]: the token embedding when tied."""
    if kind == "gpt2":
        return w["transformer.wte.weight"]
    tied = CONFIGS[kind]["tie_word_embeddings"]
    return w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq*D], causal, GQA by head // group."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores[:, np.triu(np.ones((t, t), bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * d)


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _gpt2(w: Weights, ids: list[int]) -> np.ndarray:
    c, p = CONFIGS["gpt2"], "transformer."
    eps, heads = c["layer_norm_epsilon"], c["n_head"]
    x = w[f"{p}wte.weight"][ids] + w[f"{p}wpe.weight"][: len(ids)]
    for layer in range(c["n_layer"]):
        b = f"{p}h.{layer}."
        a = _layer_norm(x, w[f"{b}ln_1.weight"], w[f"{b}ln_1.bias"], eps)
        qkv = a @ w[f"{b}attn.c_attn.weight"] + w[f"{b}attn.c_attn.bias"]
        q, k, v = (part.reshape(len(ids), heads, -1) for part in np.split(qkv, 3, axis=-1))
        x = x + _attention(q, k, v) @ w[f"{b}attn.c_proj.weight"] + w[f"{b}attn.c_proj.bias"]
        m = _layer_norm(x, w[f"{b}ln_2.weight"], w[f"{b}ln_2.bias"], eps)
        f = m @ w[f"{b}mlp.c_fc.weight"] + w[f"{b}mlp.c_fc.bias"]
        f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f**3)))
        x = x + f @ w[f"{b}mlp.c_proj.weight"] + w[f"{b}mlp.c_proj.bias"]
    return _layer_norm(x, w[f"{p}ln_f.weight"], w[f"{p}ln_f.bias"], eps)


def _rms(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    t, _, d = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(t)[:, None] * inv_freq[None]
    angles = np.concatenate([angles, angles], -1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _linear(w: Weights, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def _llama(
    kind: str, w: Weights, ids: list[int], config: dict[str, Any] | None = None
) -> np.ndarray:
    c = config or CONFIGS[kind]
    eps, theta, t = c["rms_norm_eps"], c["rope_theta"], len(ids)
    x = w["model.embed_tokens.weight"][ids]
    for layer in range(c["num_hidden_layers"]):
        b = f"model.layers.{layer}."
        a = _rms(x, w[f"{b}input_layernorm.weight"], eps)
        q = _rope(
            _linear(w, f"{b}self_attn.q_proj", a).reshape(t, c["num_attention_heads"], -1), theta
        )
        k = _rope(
            _linear(w, f"{b}self_attn.k_proj", a).reshape(t, c["num_key_value_heads"], -1), theta
        )
        v = _linear(w, f"{b}self_attn.v_proj", a).reshape(t, c["num_key_value_heads"], -1)
        x = x + _linear(w, f"{b}self_attn.o_proj", _attention(q, k, v))
        m = _rms(x, w[f"{b}post_attention_layernorm.weight"], eps)
        gate, up = _linear(w, f"{b}mlp.gate_proj", m), _linear(w, f"{b}mlp.up_proj", m)
        x = x + _linear(w, f"{b}mlp.down_proj", gate / (1 + np.exp(-gate)) * up)
    return _rms(x, w["model.norm.weight"], eps)
