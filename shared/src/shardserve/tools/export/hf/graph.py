"""One rank's stage of a Hugging Face decoder: packed-token ONNX segments around the
``attention`` ops and the collectives.

Per layer: [norm, Q|K|V of the rank's heads, rotary] -> attention(layer) -> [output
projection rows] -> allreduce -> [residual + bias, norm, MLP columns, MLP rows] ->
allreduce -> [residual + bias, next layer's norm and Q|K|V ...]. Neighbouring pieces share
one segment wherever no collective or attention separates them; with one rank per stage
there are no allreduces, so a layer is two segments. Stage 0 starts from ``input_ids``,
the last stage ends with the final norm and LM head over ``logit_rows``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from shardserve.repo.repository import AllGatherOp, AllReduceOp, AttentionOp
from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.export.hf.plan import RankPlan
from shardserve.tools.export.hf.segments import ProgramWriter, SegmentSink
from shardserve.tools.export.hf.weights import Gpt2Weights, Linear, LlamaWeights, Norm
from shardserve.tools.onnx_graph import GraphBuilder
from shardserve.tools.slice_writer import RankSlice

__all__ = ["build_rank", "hidden_name"]

TOKENS, ROWS = "tokens", "rows"


def hidden_name(layer: int) -> str:
    """The residual stream entering ``layer`` (what a stage passes to the next)."""
    return f"hidden.{layer}"


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


class _RankGraph:
    def __init__(
        self,
        config: DecoderConfig,
        plan: RankPlan,
        weights: Gpt2Weights | LlamaWeights,
        sink: SegmentSink | None,
    ) -> None:
        self.c, self.plan, self.w = config, plan, weights
        self.out = ProgramWriter(f"stage{plan.stage}_rank{plan.local}", sink)
        self.q_heads = plan.q_heads.stop - plan.q_heads.start
        self.kv_heads = plan.kv_heads.stop - plan.kv_heads.start
        self.out.declare("input_ids", [TOKENS], TensorProto.INT64)
        self.out.declare("positions", [TOKENS], TensorProto.INT64)
        self.out.declare("logit_rows", [ROWS], TensorProto.INT64)

    @property
    def g(self) -> GraphBuilder:
        return self.out.g

    def const(self, hint: str, value: np.ndarray) -> str:
        return self.g.constant(hint, np.ascontiguousarray(value, dtype=np.float32))

    def hidden(self, name: str) -> str:
        return self.out.declare(name, [TOKENS, self.c.hidden])

    def build(self) -> RankSlice:
        layers = self.plan.layers
        h = self.embed() if self.plan.first else self.out.take(self.hidden(hidden_name(layers[0])))
        for layer in layers:
            h = self.layer(layer, h)
        if self.plan.last:
            self.head(h)
        else:
            self.out.make("Identity", h, out=self.hidden(hidden_name(layers.stop)))
            self.out.close([hidden_name(layers.stop)])
        return RankSlice(tuple(self.out.program), dict(self.out.segments))

    # ------------------------------------------------------------ pieces

    def embed(self) -> str:
        ids = self.out.take("input_ids")
        tokens = self.g.op("Gather", self.const("embed", self.w.embedding()), ids)
        table = self.w.position_table()
        out = self.hidden(hidden_name(0))
        if table is None:
            return self.out.make("Identity", tokens, out=out)
        places = self.g.op("Gather", self.const("wpe", table), self.out.take("positions"))
        return self.out.make("Add", tokens, places, out=out)

    def norm(self, x: str, norm: Norm) -> str:
        gamma = self.const("norm.gamma", norm.gamma)
        if norm.beta is not None:
            beta = self.const("norm.beta", norm.beta)
            return self.g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=self.c.norm_eps)
        mean_square = self.g.op("ReduceMean", self.g.op("Mul", x, x), axes=[-1], keepdims=1)
        root = self.g.op(
            "Sqrt", self.g.op("Add", mean_square, self.const("eps", _f32(self.c.norm_eps)))
        )
        return self.g.op("Mul", gamma, self.g.op("Div", x, root))

    def linear(self, x: str, linear: Linear, hint: str, out: str | None = None) -> str:
        # the head's weight is plainly "lm_head" (int4-mixed picks its precision by that name)
        ins = [x, self.const(hint if hint == "lm_head" else f"{hint}.weight", linear.weight)]
        if linear.blocks is not None:  # quantized at the source: the quantize pass keeps them
            self.out.blocks[ins[1]] = linear.blocks
        if linear.bias is not None:
            ins.append(self.const(f"{hint}.bias", linear.bias))
        if out is not None:
            return self.out.make("Gemm", *ins, out=out, transB=int(linear.out_major))
        return self.g.op("Gemm", *ins, transB=int(linear.out_major))

    def layer(self, layer: int, h: str) -> str:
        mid = self.attention_block(layer, h)
        return self.mlp_block(layer, mid)

    def attention_block(self, layer: int, h: str) -> str:
        d = self.c.head_dim
        qkv = self.linear(
            self.norm(h, self.w.norm(layer, second=False)), self.w.qkv(layer, self.plan), "qkv"
        )
        widths = [self.q_heads * d, self.kv_heads * d, self.kv_heads * d]
        q, k, v = self.g.op_n("Split", qkv, self.g.ints("qkv_widths", widths), outputs=3, axis=-1)
        names = [f"layer{layer}.{n}" for n in ("q", "k", "v")]
        shapes = [self.q_heads, self.kv_heads, self.kv_heads]
        for name, heads in zip(names, shapes, strict=True):
            self.out.declare(name, [TOKENS, heads, d])
        q = self.g.op("Reshape", q, self.g.ints("q_shape", [-1, self.q_heads, d]))
        k = self.g.op("Reshape", k, self.g.ints("kv_shape", [-1, self.kv_heads, d]))
        if self.c.rope_theta:
            q, k = self.rotary(q), self.rotary(k)
        for value, name in zip((q, k), names[:2], strict=True):
            self.out.make("Identity", value, out=name)
        self.out.make("Reshape", v, self.g.ints("kv_shape", [-1, self.kv_heads, d]), out=names[2])
        attn = self.out.declare(f"layer{layer}.attn", [TOKENS, self.q_heads * d])
        self.out.cut(
            AttentionOp(layer=layer, q=names[0], k=names[1], v=names[2], output=attn), carry=[h]
        )
        proj, bias = self.w.out_proj(layer, self.plan)
        partial = self.linear(self.out.take(attn), proj, "o_proj")
        return self.residual(self.out.take(h), partial, bias, f"layer{layer}.attn")

    def mlp_block(self, layer: int, h: str) -> str:
        x = self.linear(
            self.norm(h, self.w.norm(layer, second=True)), self.w.mlp_in(layer, self.plan), "mlp_in"
        )
        act = self.gelu(x) if self.c.family == "gpt2" else self.swiglu(x)
        down, bias = self.w.mlp_out(layer, self.plan)
        partial = self.linear(act, down, "mlp_out")
        return self.residual(h, partial, bias, f"layer{layer}.mlp")

    def residual(self, h: str, partial: str, bias: np.ndarray | None, hint: str) -> str:
        """``h + sum over ranks(partial) + bias``: the bias added once, after the allreduce."""
        if self.plan.ranks > 1:
            self.out.make("Identity", partial, out=self.hidden(f"{hint}.partial"))
            total = self.hidden(f"{hint}.sum")
            self.out.cut(AllReduceOp(input=f"{hint}.partial", output=total), carry=[h])
            partial, h = self.out.take(total), self.out.take(h)
        if bias is not None:
            partial = self.g.op("Add", partial, self.const(f"{hint}.bias", bias))
        return self.out.make("Add", h, partial, out=self.hidden(f"{hint}.out"))

    def rotary(self, x: str) -> str:
        """HF ``rotate_half`` RoPE: x*cos + [-x2, x1]*sin over positions (fp32 throughout)."""
        cos, sin = self.rotary_tables()
        x1, x2 = self.g.op_n(
            "Split", x, self.g.ints("halves", [self.c.head_dim // 2] * 2), outputs=2, axis=-1
        )
        rotated = self.g.op("Concat", self.g.op("Neg", x2), x1, axis=-1)
        return self.g.op("Add", self.g.op("Mul", x, cos), self.g.op("Mul", rotated, sin))

    def rotary_tables(self) -> tuple[str, str]:
        """cos, sin [N, 1, D] of the rows' positions (built per segment that needs them)."""
        d = self.c.head_dim
        exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        inv_freq = (np.float32(1.0) / (np.float32(self.c.rope_theta) ** exponents)).astype(
            np.float32
        )
        pos = self.g.op("Cast", self.out.take("positions"), to=TensorProto.FLOAT)
        freqs = self.g.op(
            "Mul",
            self.g.op("Unsqueeze", pos, self.g.ints("axis1", [1])),
            self.const("inv_freq", inv_freq),
        )
        angles = self.g.op(
            "Unsqueeze", self.g.op("Concat", freqs, freqs, axis=-1), self.g.ints("axis1", [1])
        )
        return self.g.op("Cos", angles), self.g.op("Sin", angles)

    def gelu(self, x: str) -> str:
        if self.c.activation == "gelu":  # the erf form
            erf = self.g.op(
                "Erf", self.g.op("Mul", x, self.const("inv_sqrt2", _f32(1 / np.sqrt(2))))
            )
            return self.g.op(
                "Mul",
                self.g.op("Mul", x, self.const("half", _f32(0.5))),
                self.g.op("Add", erf, self.const("one", _f32(1.0))),
            )
        cube = self.g.op("Mul", self.g.op("Mul", x, x), x)
        inner = self.g.op("Add", x, self.g.op("Mul", cube, self.const("c", _f32(0.044715))))
        tanh = self.g.op("Tanh", self.g.op("Mul", inner, self.const("k", _f32(np.sqrt(2 / np.pi)))))
        half_x = self.g.op("Mul", x, self.const("half", _f32(0.5)))
        return self.g.op("Mul", half_x, self.g.op("Add", tanh, self.const("one", _f32(1.0))))

    def swiglu(self, x: str) -> str:
        width = self.plan.mlp.stop - self.plan.mlp.start
        gate, up = self.g.op_n(
            "Split", x, self.g.ints("gate_up", [width, width]), outputs=2, axis=-1
        )
        silu = self.g.op("Mul", gate, self.g.op("Sigmoid", gate))
        return self.g.op("Mul", silu, up)

    def head(self, h: str) -> None:
        rows = self.g.op("Gather", self.out.take(h), self.out.take("logit_rows"), axis=0)
        x = self.norm(rows, self.w.final_norm())
        split = self.plan.ranks > 1 and self.plan.vocab is not None
        weight = self.w.lm_head(self.plan.vocab if split else None)
        width = self.c.vocab // self.plan.ranks if split else self.c.vocab
        name = self.out.declare("logits.shard" if split else "logits", [ROWS, width])
        self.linear(x, weight, "lm_head", out=name)
        self.out.close([name])
        if split:
            self.out.program.append(AllGatherOp(input=name, output="logits", axis=-1))


def build_rank(
    config: DecoderConfig,
    plan: RankPlan,
    weights: Gpt2Weights | LlamaWeights,
    sink: SegmentSink | None = None,
) -> RankSlice:
    """One rank's stage program and its ONNX segments (handed to ``sink`` as each is
    finished when given: then the RankSlice's ``segments`` stay empty)."""
    return _RankGraph(config, plan, weights, sink).build()
