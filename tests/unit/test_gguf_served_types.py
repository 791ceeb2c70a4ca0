"""Issue 37, "GGUF in": without ``--quantize`` each linear weight is served at the precision
its GGUF type maps to (``shardserve.tools.export.gguf.precision``). GGUF files are written
here from the F32 Llama fixture with the types the ``gguf`` package can write (Q4_1, Q5_0,
Q5_1; the K-quants it only reads): Q4_1 -> int4 and Q5_0 / Q5_1 -> int8, blocks of 32, each
rank's MatMulNBits codes and scales equal to a numpy reference (the ``gguf`` package's
dequantize, then symmetric blocks of 32 rounded half to even), at TP 1 and 2; projections
fused with a higher type take its precision; F32 stays fp32; ``--quantize`` overrides; the
printed summary states the mapping. Before: every such weight was dequantized to fp32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from shardserve.tools.export.gguf import export_gguf
from shardserve.tools.export.gguf.precision import served_bits
from shardserve.tools.export.gguf.tensors import unpermute_rows
from shardserve.tools.quantize import QuantizeSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, MLP = 4, 2, 64, 128  # the tiny Llama (tests/fixtures/hf/llama)
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")


def requantized_copy(path: Path, kind_of: Callable[[str], Q]) -> Path:
    """llama-f32.gguf written again with each linear weight of type ``kind_of(name)``."""
    reader = gguf.GGUFReader(FIXTURES / "llama-f32.gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        values = np.asarray(tensor.data, np.float32).reshape(tuple(reversed(tensor.shape)))
        kind = kind_of(tensor.name) if _is_linear(tensor.name) else Q.F32
        if kind == Q.F32:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _is_linear(name: str) -> bool:
    return name.removesuffix(".weight").split(".")[-1] in LINEAR


def reference_blocks(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's symmetric blocks of 32 of ``values`` [N, K] as the slice format defines them
    (``shardserve.tools.quantize.blocks``): the scale maps the largest magnitude onto -2**(bits-1),
    for 4 bits the one of 16 shrunk scales (0.7 to 1) with the least squared error; codes
    rounded half to even, shifted to unsigned. Returns (codes [N, K/32, 32], scales [N, K/32])."""
    n, k = values.shape
    zero = 2 ** (bits - 1)
    blocks = values.reshape(n, k // 32, 32).astype(np.float32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    scales = (peak / np.float32(-zero)).astype(np.float32)
    if bits == 4:
        alphas = np.linspace(0.7, 1.0, 16, dtype=np.float32)
        trials = (scales[None] * alphas[:, None, None]).astype(np.float32)
        codes = np.clip(np.rint(blocks[None] / trials[..., None]), -zero, zero - 1)
        errors = np.square(codes * trials[..., None] - blocks[None]).sum(-1)
        scales = np.take_along_axis(trials, errors.argmin(0)[None], 0)[0]
    codes = np.clip(np.rint(blocks / scales[..., None]), -zero, zero - 1) + zero
    return codes.astype(np.uint8), scales


def dequantized(file: Path, name: str) -> np.ndarray:
    """A GGUF tensor dequantized by the ``gguf`` package, in the Hugging Face row order."""
    tensor = next(t for t in gguf.GGUFReader(file).tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data, Q(tensor.tensor_type))
    values = values.reshape(tuple(reversed(tensor.shape)))
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name.split(".")[-2])
    return unpermute_rows(values, heads) if heads else values


def exported(rank_dir: Path) -> dict[str, list[tuple[int, np.ndarray, np.ndarray]]]:
    """The rank's MatMulNBits weights by hint, in program order: (bits, codes, scales)."""
    found: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    files = sorted(rank_dir.glob("segment*.onnx"), key=lambda p: int(p.stem[7:]))
    for path in files:
        model = onnx.load(path)
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type != "MatMulNBits":
                continue
            bits = next(a.i for a in node.attribute if a.name == "bits")
            packed = inits[node.input[1]]
            codes = _unpacked(packed, bits)
            scales = inits[node.input[2]].reshape(packed.shape[:2])
            found.setdefault(node.input[1].split(".")[0], []).append((bits, codes, scales))
    return found


def _unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def expected(file: Path, layer: int, rank: int, ranks: int, bits: dict[str, int]) -> dict:
    """What rank ``rank`` of ``ranks`` holds of ``layer``: (bits, codes, scales) per hint."""

    def part(size: int) -> slice:
        return slice(rank * size // ranks, (rank + 1) * size // ranks)

    def rows(name: str, width: int) -> np.ndarray:
        return dequantized(file, f"blk.{layer}.{name}.weight")[part(width)]

    def cols(name: str, width: int) -> np.ndarray:
        return dequantized(file, f"blk.{layer}.{name}.weight")[:, part(width)]

    q, kv = HEADS * 16, KV_HEADS * 16
    weights = {
        "qkv": np.concatenate([rows("attn_q", q), rows("attn_k", kv), rows("attn_v", kv)]),
        "o_proj": cols("attn_output", q),
        "mlp_in": np.concatenate([rows("ffn_gate", MLP), rows("ffn_up", MLP)]),
        "mlp_out": cols("ffn_down", MLP),
    }
    return {hint: (bits[hint], *reference_blocks(w, bits[hint])) for hint, w in weights.items()}


def all_of(kind: Q) -> Callable[[str], Q]:
    return lambda name: kind


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(("kind", "bits"), [(Q.Q4_1, 4), (Q.Q5_0, 8), (Q.Q5_1, 8)])
def test_other_types_are_requantized_to_the_nearest_precision(
    kind: Q, bits: int, ranks: int, tmp_path: Path
) -> None:
    file = requantized_copy(tmp_path / f"llama-{kind.name}.gguf", all_of(kind))
    lines: list[str] = []
    export_gguf(file, tmp_path / "out", rank_size=ranks, name="m", progress=lines.append)
    want = f"{kind.name} x29 -> int{bits} blocks of 32 (dequantized, re-quantized)"
    assert any(want in line for line in lines), lines
    for rank in range(ranks):
        got = exported(tmp_path / "out" / "m" / "1" / f"rank_{rank}")
        assert sorted(got) == ["lm_head", "mlp_in", "mlp_out", "o_proj", "qkv"]
        for layer in range(4):
            formats = dict.fromkeys(("qkv", "o_proj", "mlp_in", "mlp_out"), bits)
            for hint, (want_bits, codes, scales) in expected(
                file, layer, rank, ranks, formats
            ).items():
                got_bits, got_codes, got_scales = got[hint][layer]
                assert got_bits == want_bits, hint
                np.testing.assert_array_equal(got_codes.reshape(codes.shape), codes)
                np.testing.assert_allclose(got_scales, scales, rtol=1e-6)


def test_fused_projections_take_the_highest_precision_and_f32_stays(tmp_path: Path) -> None:
    """Q and K Q4_1 beside V Q5_0 (as Q4_K_M puts Q6_K beside Q4_K): the fused QKV is int8;
    gate and up F32: the fused MLP input stays fp32; down Q4_1: int4."""
    kinds = {"attn_v": Q.Q5_0, "ffn_gate": Q.F32, "ffn_up": Q.F32}

    def kind_of(name: str) -> Q:
        return kinds.get(name.split(".")[-2], Q.Q4_1)

    file = requantized_copy(tmp_path / "llama-mixed.gguf", kind_of)
    lines: list[str] = []
    export_gguf(file, tmp_path / "out", name="m", progress=lines.append)
    summary = next(line for line in lines if line.startswith("GGUF linear weights"))
    assert (
        "Q4_1 x8 -> int8 blocks of 32 (dequantized, re-quantized) (fused with a higher" in summary
    )
    assert "F32 x8 -> fp32" in summary
    got = exported(tmp_path / "out" / "m" / "1" / "rank_0")
    assert "mlp_in" not in got  # fp32 MatMul
    for layer in range(4):
        formats = {"qkv": 8, "o_proj": 4, "mlp_in": 4, "mlp_out": 4}
        want = expected(file, layer, 0, 1, formats)
        for hint in ("qkv", "o_proj", "mlp_out"):
            want_bits, codes, scales = want[hint]
            got_bits, got_codes, got_scales = got[hint][layer]
            assert got_bits == want_bits, hint
            np.testing.assert_array_equal(got_codes.reshape(codes.shape), codes)
            np.testing.assert_allclose(got_scales, scales, rtol=1e-6)


def test_quantize_overrides_the_mapping(tmp_path: Path) -> None:
    file = requantized_copy(tmp_path / "llama-q5_0.gguf", all_of(Q.Q5_0))
    lines: list[str] = []
    spec = QuantizeSpec("int4", 32)
    export_gguf(file, tmp_path / "out", name="m", quantize=spec, progress=lines.append)
    assert any("Q5_0 x29 -> int4 (--quantize" in line for line in lines), lines
    got = exported(tmp_path / "out" / "m" / "1" / "rank_0")
    assert {bits for parts in got.values() for bits, _, _ in parts} == {4}


def test_quantize_fp32_serves_every_weight_dequantized(tmp_path: Path) -> None:
    file = requantized_copy(tmp_path / "llama-q4_1.gguf", all_of(Q.Q4_1))
    lines: list[str] = []
    spec = QuantizeSpec("fp32")
    export_gguf(file, tmp_path / "out", name="m", quantize=spec, progress=lines.append)
    assert any("Q4_1 x29 -> fp32 (--quantize)" in line for line in lines), lines
    assert exported(tmp_path / "out" / "m" / "1" / "rank_0") == {}


def test_an_f32_file_stays_fp32(tmp_path: Path) -> None:
    lines: list[str] = []
    export_gguf(FIXTURES / "llama-f32.gguf", tmp_path, name="m", progress=lines.append)
    assert any("F32 x29 -> fp32" in line for line in lines), lines
    assert exported(tmp_path / "m" / "1" / "rank_0") == {}


def test_the_mapping_of_every_type() -> None:
    four = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ2_XS", "TQ1_0")
    assert {name: served_bits(Q[name]) for name in four} == dict.fromkeys(four, 4)
    eight = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
    assert {name: served_bits(Q[name]) for name in eight} == dict.fromkeys(eight, 8)
    assert {served_bits(Q[name]) for name in ("F32", "F16", "BF16", "F64", "I8")} == {None}
