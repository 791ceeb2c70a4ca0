"""One rank's stage of a Hugging Face decoder: packed-token ONNX segments around the
``attention`` ops and the collectives.

Per layer: [norm, Q|K|V of the rank's heads, rotary] -> attention(layer) -> [output
projection rows] -> allreduce -> [residual + bias, norm, MLP columns, MLP rows] ->
allreduce -> [residual + bias, next layer's norm and Q|K|V ...]. Neighbouring pieces share
one segment wherever no collective or attention separates them; with one rank per stage
there are no allreduces, so a layer is two segments. Stage 0 starts from ``input_ids``,
the last stage ends with the final norm and LM head over ``logit_rows``.

Few, big kernels (a decode step of one sequence is mostly fixed per-kernel cost): Q|K|V and
gate|up are one projection each; a residual add and the norm after it are one
onnxruntime ``Skip[Simplified]LayerNormalization`` (its fourth output is the sum); RoPE is
onnxruntime's ``RotaryEmbedding`` over cos/sin tables of the rows' positions, made once per
stage in its first segment and carried to the others. 125 M Llama, one rank: 658 nodes a
step before, 224 after (onnxruntime's profiler: docs/performance.md)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from shardserve.errors import InternalError
from shardserve.repo.repository import AllGatherOp, AllReduceOp, AttentionOp
from shardserve.tools.export.hf.config import DecoderConfig
from shardserve.tools.export.hf.plan import RankPlan
from shardserve.tools.export.hf.segments import ProgramWriter, SegmentSink
from shardserve.tools.export.hf.weights import Gpt2Weights, Linear, LlamaWeights, Norm
from shardserve.tools.onnx_graph import MS_DOMAIN, GraphBuilder
from shardserve.tools.slice_writer import RankSlice

__all__ = ["build_rank", "hidden_name"]

TOKENS, ROWS = "tokens", "rows"
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"


def hidden_name(layer: int) -> str:
    """The residual stream entering ``layer`` (what a stage passes to the next)."""
    return f"hidden.{layer}"


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def _given(x: str | None) -> str:
    """A layer's input norm: present wherever the stage holds the layer."""
    if x is None:
        raise InternalError("a layer's norm was not made")
    return x


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
        if self.c.rope_theta:
            self.rotary_tables()
        x: str | None = self.norm(h, self.w.norm(layers[0], second=False))
        for layer in layers:
            h, x = self.layer(layer, h, x)
        if self.plan.last:
            self.head(h)
        else:
            self.out.make("Identity", h, out=self.hidden(hidden_name(layers.stop)))
            self.out.close([hidden_name(layers.stop)])
        return RankSlice(tuple(self.out.program), dict(self.out.segments))

    # ------------------------------------------------------------ pieces

    def embed(self) -> str:
        ids = self.out.take("input_ids")
        table = self.w.position_table()
        out = self.hidden(hidden_name(0))
        if table is None:
            return self.out.make("Gather", self.const("embed", self.w.embedding()), ids, out=out)
        tokens = self.g.op("Gather", self.const("embed", self.w.embedding()), ids)
        places = self.g.op("Gather", self.const("wpe", table), self.out.take("positions"))
        return self.out.make("Add", tokens, places, out=out)

    def norm(self, x: str, norm: Norm) -> str:
        """A norm with no residual before it (a stage's first, the final one). RMSNorm in
        the form onnxruntime fuses into one ``SimplifiedLayerNormalization`` kernel."""
        gamma = self.const("norm.gamma", norm.gamma)
        if norm.beta is not None:
            beta = self.const("norm.beta", norm.beta)
            return self.g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=self.c.norm_eps)
        mean_square = self.g.op(
            "ReduceMean", self.g.op("Pow", x, self.const("two", _f32(2.0))), axes=[-1], keepdims=1
        )
        root = self.g.op(
            "Sqrt", self.g.op("Add", mean_square, self.const("eps", _f32(self.c.norm_eps)))
        )
        return self.g.op("Mul", self.g.op("Div", x, root), gamma)

    def skip_norm(self, h: str, partial: str, bias: np.ndarray | None, norm: Norm, out: str) -> str:
        """``out = h + partial + bias`` and its norm, in one onnxruntime kernel
        (``Skip[Simplified]LayerNormalization``); returns the norm."""
        ins = [h, partial, self.const("norm.gamma", norm.gamma)]
        if norm.beta is not None:
            ins.append(self.const("norm.beta", norm.beta))
        if bias is not None:
            ins.append(self.const("residual.bias", bias))
        op = "SkipSimplifiedLayerNormalization" if norm.beta is None else "SkipLayerNormalization"
        normed, *_ = self.out.make_n(
            op, *ins, outputs=[None, "", "", out], domain=MS_DOMAIN, epsilon=self.c.norm_eps
        )
        return normed

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

    def layer(self, layer: int, h: str, x: str | None) -> tuple[str, str | None]:
        """The residual stream after ``layer`` and, when this stage holds the next layer,
        that layer's first norm of it (``x``: this layer's)."""
        h, x = self.attention_block(layer, h, x)
        return self.mlp_block(layer, h, x)

    def attention_block(self, layer: int, h: str, x: str | None) -> tuple[str, str]:
        qkv = self.linear(_given(x), self.w.qkv(layer, self.plan), "qkv")
        q, k, v = self.heads(layer, qkv)
        attn = self.out.declare(f"layer{layer}.attn", [TOKENS, self.q_heads * self.c.head_dim])
        self.out.cut(AttentionOp(layer=layer, q=q, k=k, v=v, output=attn), carry=[h])
        proj, bias = self.w.out_proj(layer, self.plan)
        hint = f"layer{layer}.attn"
        partial = self.linear(self.out.take(attn), proj, "o_proj", out=self.partial(hint))
        h, normed = self.residual(self.out.take(h), partial, bias, hint, self.w.norm(layer, True))
        return h, _given(normed)

    def heads(self, layer: int, qkv: str) -> list[str]:
        """Q, K, V [N, heads, D] of the fused projection, RoPE applied to Q and K."""
        d = self.c.head_dim
        widths = [self.q_heads * d, self.kv_heads * d, self.kv_heads * d]
        # [1, N, W]: RotaryEmbedding's [batch, sequence, hidden] (a view, not a copy)
        rows = self.g.op("Unsqueeze", qkv, self.g.ints("axis0", [0]))
        parts = self.g.op_n("Split", rows, self.g.ints("qkv_widths", widths), outputs=3, axis=-1)
        heads = [self.q_heads, self.kv_heads, self.kv_heads]
        if self.c.rope_theta:
            parts[:2] = [self.rotary(part, n) for part, n in zip(parts[:2], heads[:2], strict=True)]
        names = []
        for part, name, n in zip(parts, ("q", "k", "v"), heads, strict=True):
            shape = self.g.ints(f"{name}_shape", [-1, n, d])
            names.append(self.out.declare(f"layer{layer}.{name}", [TOKENS, n, d]))
            self.out.make("Reshape", part, shape, out=names[-1])
        return names

    def mlp_block(self, layer: int, h: str, x: str) -> tuple[str, str | None]:
        x = self.linear(x, self.w.mlp_in(layer, self.plan), "mlp_in")
        act = self.gelu(x) if self.c.family == "gpt2" else self.swiglu(x)
        down, bias = self.w.mlp_out(layer, self.plan)
        hint = f"layer{layer}.mlp"
        partial = self.linear(act, down, "mlp_out", out=self.partial(hint))
        following = layer + 1 in self.plan.layers
        next_norm = self.w.norm(layer + 1, second=False) if following else None
        return self.residual(h, partial, bias, hint, next_norm)

    def partial(self, hint: str) -> str | None:
        """The declared name a rank's partial sum gets when an allreduce follows it."""
        return self.hidden(f"{hint}.partial") if self.plan.ranks > 1 else None

    def residual(
        self, h: str, partial: str, bias: np.ndarray | None, hint: str, norm: Norm | None
    ) -> tuple[str, str | None]:
        """``h + sum over ranks(partial) + bias`` (the bias added once, after the
        allreduce) and, given ``norm``, its norm."""
        if self.plan.ranks > 1:
            total = self.hidden(f"{hint}.sum")
            self.out.cut(AllReduceOp(input=partial, output=total), carry=[h])
            partial, h = self.out.take(total), self.out.take(h)
        out = self.hidden(f"{hint}.out")
        if norm is not None:
            return out, self.skip_norm(h, partial, bias, norm, out)
        if bias is not None:
            partial = self.g.op("Add", partial, self.const(f"{hint}.bias", bias))
        return self.out.make("Add", h, partial, out=out), None

    def rotary(self, x: str, heads: int) -> str:
        """HF ``rotate_half`` RoPE of ``x`` [1, N, heads*D] (onnxruntime's RotaryEmbedding
        over the stage's tables: position ids start at row 0 of them)."""
        cos, sin = self.out.take(ROPE_COS), self.out.take(ROPE_SIN)
        start = self.g.ints("rope_start", [0])
        return self.g.op(
            "RotaryEmbedding", x, start, cos, sin, domain=MS_DOMAIN, num_heads=heads, interleaved=0
        )

    def rotary_tables(self) -> None:
        """cos, sin [N, D/2] of the rows' positions, made once in the stage's first segment
        and carried to every layer's (fp32 throughout, as Hugging Face computes them)."""
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
        for name, op in ((ROPE_COS, "Cos"), (ROPE_SIN, "Sin")):
            self.out.make(op, freqs, out=self.out.declare(name, [TOKENS, d // 2]))
        self.out.carried = [ROPE_COS, ROPE_SIN]

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
