"""Where each architecture keeps its weights, and the pieces of them one rank needs.

Both families are described by the same questions (embedding, norms, fused Q|K|V of the
rank's heads, output projection rows, MLP in/out, LM head rows), so the graph builder does
not know which checkpoint it reads. Projections come in the checkpoint's own orientation
(``Linear.out_major``: nn.Linear is [out, in], GPT-2's Conv1D is [in, out]) and the graph
multiplies with ``Gemm(transB=...)``, so nothing is transposed (copied) at export.

A source that holds some weights already quantized (a GGUF file's Q8_0/Q4_0 tensors) also
hands out the rank's part of them as blocks (``Linear.blocks``): the quantize pass then
keeps them instead of rounding the fp32 weight again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np

from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.export.hf.plan import RankPlan
from shardserve.tools.quantize import QuantizedBlocks

__all__ = [
    "BlockSource",
    "Linear",
    "Norm",
    "TensorSource",
    "WeightSource",
    "stacked_blocks",
    "weight_source",
]


class TensorSource(Protocol):
    """Tensors under their Hugging Face names, read as fp32 (a safetensors checkpoint, or a
    GGUF file whose tensors are renamed and dequantized)."""

    def __contains__(self, name: object) -> bool: ...

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None: ...

    def read(
        self, name: str, rows: slice | None = None, cols: slice | None = None
    ) -> np.ndarray: ...


@runtime_checkable
class BlockSource(Protocol):
    """A ``TensorSource`` whose tensors may be quantized already: ``name[rows, cols]`` as
    ``[N, K]`` blocks, or None when it has none that fit."""

    def blocks(
        self, name: str, rows: slice | None = None, cols: slice | None = None
    ) -> QuantizedBlocks | None: ...


# (Hugging Face name, rows, cols) of the [out, in] weights a fused projection stacks on N
Part = tuple[str, slice | None, slice | None]


@dataclass(frozen=True)
class Linear:
    weight: np.ndarray
    bias: np.ndarray | None
    out_major: bool
    blocks: QuantizedBlocks | None = None  # the same weight [N, K], quantized at the source


def stacked_blocks(source: TensorSource, parts: list[Part]) -> QuantizedBlocks | None:
    """The parts' source blocks stacked on N (one Gemm's weight), or None unless every
    part has blocks of the same format."""
    if not isinstance(source, BlockSource):
        return None
    found = [source.blocks(name, rows, cols) for name, rows, cols in parts]
    present = [b for b in found if b is not None]
    formats = {(b.bits, b.block_size, b.k) for b in present}
    if len(present) < len(found) or len(formats) != 1:
        return None
    bits, block_size, k = formats.pop()
    return QuantizedBlocks(
        np.concatenate([b.packed for b in present]),
        np.concatenate([b.scales for b in present]),
        bits,
        block_size,
        k=k,
        n=sum(b.n for b in present),
    )


@dataclass(frozen=True)
class Norm:
    gamma: np.ndarray
    beta: np.ndarray | None  # None: RMSNorm


def _heads(part: slice, head_dim: int, offset: int = 0) -> slice:
    return slice(offset + part.start * head_dim, offset + part.stop * head_dim)


def _joined(parts: list[np.ndarray | None]) -> np.ndarray | None:
    """Biases of fused projections side by side (None when the projections have none)."""
    present = [p for p in parts if p is not None]
    return np.concatenate(present) if present else None


class WeightSource:
    """Common reading; subclasses name the tensors of their architecture."""

    def __init__(self, checkpoint: TensorSource, config: DecoderConfig) -> None:
        self.ckpt, self.config = checkpoint, config

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.expected_shapes()

    def check(self) -> None:
        """Every tensor the export will read exists with the shape config.json implies."""
        for name, shape in self.shapes.items():
            self.ckpt.check_shape(name, shape)

    def optional(self, name: str, rows: slice | None = None) -> np.ndarray | None:
        return self.ckpt.read(name, rows) if name in self.shapes else None


class Gpt2Weights(WeightSource):
    def __init__(self, checkpoint: TensorSource, config: DecoderConfig) -> None:
        super().__init__(checkpoint, config)
        self.prefix = "transformer." if "transformer.wte.weight" in checkpoint else ""

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c, p = self.config, self.prefix
        h, i = c.hidden, c.intermediate
        shapes: dict[str, tuple[int, ...]] = {
            f"{p}wte.weight": (c.vocab, h),
            f"{p}wpe.weight": (c.max_positions, h),
        }
        for layer in range(c.layers):
            b = f"{p}h.{layer}."
            for norm in ("ln_1", "ln_2"):
                shapes |= {f"{b}{norm}.weight": (h,), f"{b}{norm}.bias": (h,)}
            shapes |= {f"{b}attn.c_attn.weight": (h, 3 * h), f"{b}attn.c_attn.bias": (3 * h,)}
            shapes |= {f"{b}attn.c_proj.weight": (h, h), f"{b}attn.c_proj.bias": (h,)}
            shapes |= {f"{b}mlp.c_fc.weight": (h, i), f"{b}mlp.c_fc.bias": (i,)}
            shapes |= {f"{b}mlp.c_proj.weight": (i, h), f"{b}mlp.c_proj.bias": (h,)}
        return shapes | {f"{p}ln_f.weight": (h,), f"{p}ln_f.bias": (h,)}

    def embedding(self) -> np.ndarray:
        return self.ckpt.read(f"{self.prefix}wte.weight")

    def position_table(self) -> np.ndarray | None:
        return self.ckpt.read(f"{self.prefix}wpe.weight")

    def norm(self, layer: int, second: bool) -> Norm:
        b = f"{self.prefix}h.{layer}.{'ln_2' if second else 'ln_1'}"
        return Norm(self.ckpt.read(f"{b}.weight"), self.ckpt.read(f"{b}.bias"))

    def final_norm(self) -> Norm:
        b = f"{self.prefix}ln_f"
        return Norm(self.ckpt.read(f"{b}.weight"), self.ckpt.read(f"{b}.bias"))

    def qkv(self, layer: int, plan: RankPlan) -> Linear:
        name, h, d = f"{self.prefix}h.{layer}.attn.c_attn", self.config.hidden, self.config.head_dim
        picks = [_heads(plan.q_heads, d, k * h) for k in range(3)]  # GPT-2: kv heads = heads
        weight = np.concatenate([self.ckpt.read(f"{name}.weight", cols=p) for p in picks], 1)
        bias = self.ckpt.read(f"{name}.bias")
        return Linear(weight, np.concatenate([bias[p] for p in picks]), out_major=False)

    def out_proj(self, layer: int, plan: RankPlan) -> tuple[Linear, np.ndarray | None]:
        name = f"{self.prefix}h.{layer}.attn.c_proj"
        rows = _heads(plan.q_heads, self.config.head_dim)
        weight = self.ckpt.read(f"{name}.weight", rows=rows)
        return Linear(weight, None, out_major=False), self.ckpt.read(f"{name}.bias")

    def mlp_in(self, layer: int, plan: RankPlan) -> Linear:
        name = f"{self.prefix}h.{layer}.mlp.c_fc"
        weight = self.ckpt.read(f"{name}.weight", cols=plan.mlp)
        return Linear(weight, self.ckpt.read(f"{name}.bias", plan.mlp), out_major=False)

    def mlp_out(self, layer: int, plan: RankPlan) -> tuple[Linear, np.ndarray | None]:
        name = f"{self.prefix}h.{layer}.mlp.c_proj"
        weight = self.ckpt.read(f"{name}.weight", rows=plan.mlp)
        return Linear(weight, None, out_major=False), self.ckpt.read(f"{name}.bias")

    def lm_head(self, vocab: slice | None) -> Linear:
        """[vocab rows, hidden] (out-major, no bias): the tied token embedding."""
        return Linear(self.ckpt.read(f"{self.prefix}wte.weight", rows=vocab), None, True)


class LlamaWeights(WeightSource):
    """Llama, Mistral, Qwen2: the same names, biases where the config says."""

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        h, i, q, kv = c.hidden, c.intermediate, c.heads * c.head_dim, c.kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab, h),
            "model.norm.weight": (h,),
        }
        if not c.tied_head:
            shapes["lm_head.weight"] = (c.vocab, h)
        for layer in range(c.layers):
            b = f"model.layers.{layer}."
            shapes |= {f"{b}input_layernorm.weight": (h,)}
            shapes |= {f"{b}post_attention_layernorm.weight": (h,)}
            outs = {"q_proj": q, "k_proj": kv, "v_proj": kv}
            shapes |= {f"{b}self_attn.{n}.weight": (o, h) for n, o in outs.items()}
            if c.qkv_bias:
                shapes |= {f"{b}self_attn.{n}.bias": (o,) for n, o in outs.items()}
            shapes |= {f"{b}self_attn.o_proj.weight": (h, q)}
            if c.o_bias:
                shapes |= {f"{b}self_attn.o_proj.bias": (h,)}
            shapes |= {f"{b}mlp.{n}.weight": (i, h) for n in ("gate_proj", "up_proj")}
            shapes |= {f"{b}mlp.down_proj.weight": (h, i)}
            if c.mlp_bias:
                shapes |= {f"{b}mlp.{n}.bias": (i,) for n in ("gate_proj", "up_proj")}
                shapes |= {f"{b}mlp.down_proj.bias": (h,)}
        return shapes

    def embedding(self) -> np.ndarray:
        return self.ckpt.read("model.embed_tokens.weight")

    def position_table(self) -> np.ndarray | None:
        return None

    def norm(self, layer: int, second: bool) -> Norm:
        which = "post_attention_layernorm" if second else "input_layernorm"
        return Norm(self.ckpt.read(f"model.layers.{layer}.{which}.weight"), None)

    def final_norm(self) -> Norm:
        return Norm(self.ckpt.read("model.norm.weight"), None)

    def qkv(self, layer: int, plan: RankPlan) -> Linear:
        b, d = f"model.layers.{layer}.self_attn", self.config.head_dim
        picks = {
            "q_proj": _heads(plan.q_heads, d),
            "k_proj": _heads(plan.kv_heads, d),
            "v_proj": _heads(plan.kv_heads, d),
        }
        weight = np.concatenate([self.ckpt.read(f"{b}.{n}.weight", p) for n, p in picks.items()])
        biases = [self.optional(f"{b}.{n}.bias", p) for n, p in picks.items()]
        parts: list[Part] = [(f"{b}.{n}.weight", p, None) for n, p in picks.items()]
        return Linear(weight, _joined(biases), True, stacked_blocks(self.ckpt, parts))

    def out_proj(self, layer: int, plan: RankPlan) -> tuple[Linear, np.ndarray | None]:
        b = f"model.layers.{layer}.self_attn.o_proj"
        cols = _heads(plan.q_heads, self.config.head_dim)
        weight = self.ckpt.read(f"{b}.weight", cols=cols)
        blocks = stacked_blocks(self.ckpt, [(f"{b}.weight", None, cols)])
        return Linear(weight, None, True, blocks), self.optional(f"{b}.bias")

    def mlp_in(self, layer: int, plan: RankPlan) -> Linear:
        """gate | up side by side (one Gemm, split after)."""
        b = f"model.layers.{layer}.mlp"
        names = ("gate_proj", "up_proj")
        weight = np.concatenate([self.ckpt.read(f"{b}.{n}.weight", plan.mlp) for n in names])
        biases = [self.optional(f"{b}.{n}.bias", plan.mlp) for n in names]
        parts: list[Part] = [(f"{b}.{n}.weight", plan.mlp, None) for n in names]
        return Linear(weight, _joined(biases), True, stacked_blocks(self.ckpt, parts))

    def mlp_out(self, layer: int, plan: RankPlan) -> tuple[Linear, np.ndarray | None]:
        b = f"model.layers.{layer}.mlp.down_proj"
        weight = self.ckpt.read(f"{b}.weight", cols=plan.mlp)
        blocks = stacked_blocks(self.ckpt, [(f"{b}.weight", None, plan.mlp)])
        return Linear(weight, None, True, blocks), self.optional(f"{b}.bias")

    def lm_head(self, vocab: slice | None) -> Linear:
        """[vocab rows, hidden] (out-major, no bias)."""
        name = "model.embed_tokens.weight" if self.config.tied_head else "lm_head.weight"
        blocks = stacked_blocks(self.ckpt, [(name, vocab, None)])
        return Linear(self.ckpt.read(name, rows=vocab), None, True, blocks)


def weight_source(checkpoint: TensorSource, config: DecoderConfig) -> Gpt2Weights | LlamaWeights:
    source = Gpt2Weights if config.family == "gpt2" else LlamaWeights
    return source(checkpoint, config)
