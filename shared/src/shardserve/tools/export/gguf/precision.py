"""The precision each GGUF tensor type is served at when ``--quantize`` is not given.

The slice format has fp32 and ``MatMulNBits`` blocks of 32 at 8 or 4 bits. A linear weight
keeps the precision its file gave it, as nearly as the format has it:

* F32, F16, BF16 (and any other float or integer type) -> **fp32**;
* Q8_0 -> **int8**, Q4_0 -> **int4**: the file's own blocks, exactly (no second rounding);
* types of 4 bits or less a weight (Q4_1, Q4_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, the IQ1-IQ3 and
  ternary types) -> **int4, blocks of 32**: dequantized with the ``gguf`` package and
  re-quantized (symmetric, one scale a block: the format has no minimum per block);
* types of 5 to 8 bits (Q5_0, Q5_1, Q5_K, Q6_K, Q8_1, Q8_K) -> **int8, blocks of 32**, the same
  way (int4 would lose what their extra bits hold).

A projection the exporter fuses with others (Q, K and V; gate and up) is one MatMulNBits, so
its parts take the highest precision among them (llama.cpp's Q4_K_M gives V Q6_K beside
Q4_K Q and K: all three int8), and fp32 if any of them is a float type. Embeddings and norms
are not linear layers: fp32 whatever their type. ``--quantize`` overrides all of this.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gguf import GGMLQuantizationType as Q

from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.quantize import AS_SOURCE, FP32, QuantizeSpec

__all__ = ["BLOCK", "linear_weights", "served_bits", "summary"]

BLOCK = 32
_KEPT = {Q.Q8_0: 8, Q.Q4_0: 4}
_INT4 = frozenset(
    Q[name]
    for name in (
        "Q4_1 Q4_K Q3_K Q2_K IQ4_NL IQ4_XS IQ3_S IQ3_XXS IQ2_S IQ2_XS IQ2_XXS IQ1_S IQ1_M "
        "TQ1_0 TQ2_0 MXFP4 NVFP4 Q1_0"
    ).split()
    if name in Q.__members__
)
_INT8 = frozenset({Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_1, Q.Q8_K})


def served_bits(kind: Q) -> int | None:
    """8 or 4 (MatMulNBits blocks of 32) for a quantized type, None (fp32) for the rest."""
    if kind in _KEPT:
        return _KEPT[kind]
    if kind in _INT4:
        return 4
    if kind in _INT8:
        return 8
    return None


def linear_weights(config: DecoderConfig) -> list[str]:
    """The Hugging Face names of the weights served as linear layers (the LM head is the
    token embedding when it is tied)."""
    head = "model.embed_tokens.weight" if config.tied_head else "lm_head.weight"
    parts = [f"self_attn.{p}_proj" for p in "qkvo"] + [
        f"mlp.{p}_proj" for p in ("gate", "up", "down")
    ]
    layers = [f"model.layers.{i}.{p}.weight" for i in range(config.layers) for p in parts]
    return [*layers, head]


def summary(served: Iterable[tuple[Q, int | None]], quantize: QuantizeSpec | None) -> str:
    """One line: the linear weights' types, how many, and what each becomes (``served``:
    each weight's type and the bits it is served at)."""
    counts = Counter(served)
    if quantize is not None and quantize.precision != AS_SOURCE:
        types = ", ".join(f"{kind.name} x{n}" for kind, n in _by_kind(counts).items())
        kept = "" if quantize.precision == FP32 else "; Q8_0/Q4_0 blocks of it kept exactly"
        return f"GGUF linear weights: {types} -> {quantize.precision} (--quantize{kept})"
    parts = [
        f"{kind.name} x{n} -> {_becomes(kind, bits)}"
        for (kind, bits), n in sorted(counts.items(), key=_order)
    ]
    return "GGUF linear weights: " + "; ".join(parts) + " (embeddings and norms: fp32)"


def _becomes(kind: Q, bits: int | None) -> str:
    if bits is None:
        return "fp32"
    if _KEPT.get(kind) == bits:
        return f"int{bits} blocks of {BLOCK} (kept exactly)"
    promoted = " (fused with a higher type)" if served_bits(kind) != bits else ""
    return f"int{bits} blocks of {BLOCK} (dequantized, re-quantized){promoted}"


def _by_kind(counts: Counter[tuple[Q, int | None]]) -> dict[Q, int]:
    totals: Counter[Q] = Counter()
    for (kind, _), n in counts.items():
        totals[kind] += n
    return dict(sorted(totals.items()))


def _order(item: tuple[tuple[Q, int | None], int]) -> tuple[int, int]:
    (kind, bits), _ = item
    return int(kind), bits or 0
