"""Quantized slices (``--quantize int8|int4``): the block quantizer, the ``MatMulNBits``
pass, and exported tiny checkpoints run with real onnxruntime against numpy references
of the same blocks (accuracy_level 0: exact; 4: activations quantized as MLAS does)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hf_checkpoints import CONFIGS, random_weights, reference_logits, write_checkpoint
from hf_runner import PackedModel
from onnx import TensorProto, helper, numpy_helper
from quantized_reference import activation_quantized, dequantized_weights

from shardserve.cli import main
from shardserve.errors import ExportError
from shardserve.repo.repository import load_group
from shardserve.tools.export.hf import export_hf
from shardserve.tools.quantize import (
    QuantizeSpec,
    dequantize,
    matmul_nbits,
    quantize_blocks,
    quantize_model,
)

PROMPT = [5, 17, 33, 2, 9, 41, 7]
BITS = {"int8": 8, "int4": 4}


def one_node_model(node: onnx.NodeProto, inits: list[onnx.TensorProto], k: int, n: int) -> bytes:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def run(model: bytes | onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    raw = model if isinstance(model, bytes) else model.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(raw, options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---------------------------------------------------------------- blocks


def test_a_block_whose_peak_is_minus_eight_scales_by_one() -> None:
    """4 bits: the largest magnitude maps to code 0 (-8 after the zero point), integers
    in [-8, 7] come back exactly, 7.5 rounds half to even (8 -> clipped to 7)."""
    row = np.array([-8, -3, 0, 1, 7, 2.5] + [0] * 10, np.float32)
    q = quantize_blocks(row[None], 4, 16, search=False)
    assert q.scales.tolist() == [1.0]
    assert dequantize(q)[0].tolist() == [-8, -3, 0, 1, 7, 2] + [0] * 10
    assert q.packed[0, 0, 0] == (0 | (5 << 4))  # -8 -> 0 low nibble, -3 -> 5 high nibble


@pytest.mark.parametrize(("bits", "k"), [(8, 64), (4, 64), (8, 72), (4, 40)])
def test_round_trip_error_is_within_half_a_step(bits: int, k: int) -> None:
    w = np.random.default_rng(bits + k).standard_normal((24, k)).astype(np.float32)
    q = quantize_blocks(w, bits, 16, search=False)
    assert q.packed.shape == (24, -(-k // 16), 16 * bits // 8)
    step = np.repeat(np.abs(q.scales.reshape(24, -1)), 16, axis=1)[:, :k]
    # Half a step, except the opposite-signed peak clipped at +z-1: at most one step.
    assert np.all(np.abs(dequantize(q) - w) <= step * 1.0001)
    assert np.mean(np.abs(dequantize(q) - w) <= step * 0.5001) > 0.98


def test_the_scale_search_never_loses_to_the_max_scale() -> None:
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    plain = dequantize(quantize_blocks(w, 4, 32, search=False))
    searched = dequantize(quantize_blocks(w, 4, 32, search=True))
    per_block = lambda d: np.square(d - w).reshape(64, -1, 32).sum(-1)  # noqa: E731
    assert np.all(per_block(searched) <= per_block(plain) + 1e-6)
    assert per_block(searched).sum() < 0.95 * per_block(plain).sum()


@pytest.mark.parametrize(
    ("bits", "block", "match"),
    [(3, 32, "bits"), (4, 24, "power of two"), (8, 8, "power of two")],
)
def test_unsupported_formats_are_refused(bits: int, block: int, match: str) -> None:
    with pytest.raises(ExportError, match=match):
        quantize_blocks(np.zeros((4, 32), np.float32), bits, block)


# ---------------------------------------------------------------- MatMulNBits


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("k", "n", "block"), [(64, 48, 32), (72, 40, 16), (256, 32, 128)])
def test_accuracy_level_0_equals_dequantize_then_matmul(
    bits: int, k: int, n: int, block: int
) -> None:
    rng = np.random.default_rng(k * n)
    q = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), bits, block)
    bias = rng.standard_normal(n).astype(np.float32)
    built = matmul_nbits("w", q, activation="x", output="y", accuracy_level=0, bias=bias)
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(q).T.astype(np.float64) + bias
    assert relative(run(one_node_model(built.node, list(built.initializers), k, n), x), want) < 1e-6


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_accuracy_level_4_equals_a_reference_with_int8_activations(bits: int, block: int) -> None:
    rng = np.random.default_rng(bits * block)
    k, n = 128, 40
    q = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), bits, block)
    built = matmul_nbits("w", q, activation="x", output="y", accuracy_level=4)
    x = (rng.standard_normal((4, k)) * 3).astype(np.float32)
    x[0, :block] = 0.0
    x[0, 0], x[0, 1 : block // 2] = 127.0, np.arange(block // 2 - 1) + 0.5  # exact ties
    got = run(one_node_model(built.node, list(built.initializers), k, n), x)
    weights = dequantize(q).T.astype(np.float64)
    assert relative(got, activation_quantized(x, block).astype(np.float64) @ weights) < 1e-5
    # The fp32-activation reference is ~5e-3 away: the test tells the two apart.
    assert relative(got, x.astype(np.float64) @ weights) > 1e-4


def gemm_model(trans_b: int, with_bias: bool, alpha: float = 1.0) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((32, 64) if trans_b else (64, 32)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if with_bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Gemm", inputs, ["y"], "gemm", transB=trans_b, alpha=alpha)
    return onnx.load_from_string(one_node_model(node, inits, 64, 32))


@pytest.mark.parametrize(("trans_b", "with_bias"), [(0, False), (1, False), (1, True)])
def test_gemm_and_matmul_nodes_become_matmulnbits_with_the_same_product(
    trans_b: int, with_bias: bool
) -> None:
    model = gemm_model(trans_b, with_bias)
    quantized = quantize_model(model, QuantizeSpec("int8", 32, accuracy_level=0))
    assert [n.op_type for n in quantized.graph.node] == ["MatMulNBits"]
    assert {t.name for t in quantized.graph.initializer} == (
        {"w.q8", "w.scales", "w.bias"} if with_bias else {"w.q8", "w.scales"}
    )
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    assert relative(run(quantized, x), run(model, x)) < 2e-2


def test_nodes_it_cannot_express_are_left_alone() -> None:
    model = gemm_model(1, True, alpha=0.5)
    assert quantize_model(model, QuantizeSpec("int4")) is model


def test_a_weight_also_read_by_another_node_is_kept() -> None:
    weight = numpy_helper.from_array(np.ones((32, 32), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])],
        [weight],
    )
    quantized = quantize_model(helper.make_model(graph), QuantizeSpec("int8"))
    assert {t.name for t in quantized.graph.initializer} == {"w", "w.q8", "w.scales"}


def block_sizes(model: onnx.ModelProto) -> list[int]:
    return [a.i for node in model.graph.node for a in node.attribute if a.name == "block_size"]


def test_without_a_block_size_8_bits_take_blocks_of_128_and_4_bits_blocks_of_32() -> None:
    model = gemm_model(1, False)
    assert block_sizes(quantize_model(model, QuantizeSpec("int8"))) == [128]
    assert block_sizes(quantize_model(model, QuantizeSpec("int4"))) == [32]
    assert block_sizes(quantize_model(model, QuantizeSpec("int8", 32))) == [32]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    padded = quantize_model(model, QuantizeSpec("int8", accuracy_level=0))  # K 64 < 128
    assert relative(run(padded, x), run(model, x)) < 2e-2


def test_a_sources_own_blocks_are_kept_unless_another_size_is_asked() -> None:
    model = gemm_model(1, False)  # Gemm with transB: the weight is [N, K] as stored
    weight_nk = numpy_helper.to_array(model.graph.initializer[0])
    source = quantize_blocks(weight_nk, 8, 32)  # a GGUF file's Q8_0 blocks, say
    kept = quantize_model(model, QuantizeSpec("int8"), {"w": source})
    assert block_sizes(kept) == [32]
    codes = next(t for t in kept.graph.initializer if t.name == "w.q8")
    assert np.array_equal(numpy_helper.to_array(codes), source.packed)
    assert block_sizes(quantize_model(model, QuantizeSpec("int8", 64), {"w": source})) == [64]
    assert block_sizes(quantize_model(model, QuantizeSpec("int4"), {"w": source})) == [32]


# ---------------------------------------------------------------- exported checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: write_checkpoint(root / kind, kind, random_weights(kind)) for kind in CONFIGS}


def exported(checkpoint: Path, out: Path, tp: int, pp: int, spec: QuantizeSpec) -> PackedModel:
    name = f"m{tp}x{pp}_{spec.precision}_{spec.block_size}_{spec.accuracy_level}"
    export_hf(checkpoint, out, rank_size=tp * pp, stage_size=pp, name=name, quantize=spec)
    return PackedModel(out, name)


def prefill(model: PackedModel, ids: list[int] = PROMPT) -> np.ndarray:
    model.reserve(1, len(ids))
    return model.step([(1, 0, len(ids))], ids)


def dequantized_reference(kind: str, spec: QuantizeSpec) -> np.ndarray:
    weights, head = dequantized_weights(kind, random_weights(kind), spec.bits, spec.block_size)
    return reference_logits(kind, weights, PROMPT, head=head)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_level_0_logits_equal_the_dequantized_reference(
    kind: str, precision: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    spec = QuantizeSpec(precision, 32, accuracy_level=0)
    got = prefill(exported(checkpoints[kind], tmp_path, 1, 1, spec))
    want = dequantized_reference(kind, spec)
    assert relative(got, want) < 1e-4
    # ... and the quantization is real: fp32 logits are further away.
    assert relative(got, reference_logits(kind, random_weights(kind), PROMPT)) > 1e-3


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_level_4_logits_stay_near_the_dequantized_reference(
    kind: str, precision: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Every linear layer's activations are rounded to int8 (~0.4 % per matmul, measured
    5e-3 on one): over the tiny models' 2-4 layers the logits stay within 3 %."""
    spec = QuantizeSpec(precision, 32, accuracy_level=4)
    got = prefill(exported(checkpoints[kind], tmp_path, 1, 1, spec))
    want = dequantized_reference(kind, spec)
    assert relative(got, want) < 3e-2
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("level", [0, 4])
def test_sliced_equals_unsliced_at_each_precision(
    kind: str, precision: str, level: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Blocks of 16 divide every rank's share of K, so each rank holds exactly the blocks
    of the unsliced model: only the summation order differs."""
    spec = QuantizeSpec(precision, 16, accuracy_level=level)
    whole = prefill(exported(checkpoints[kind], tmp_path, 1, 1, spec))
    sliced = prefill(exported(checkpoints[kind], tmp_path, 2, 2, spec))
    assert np.array_equal(sliced.argmax(-1), whole.argmax(-1))
    assert relative(sliced, whole) < (1e-5 if level == 0 else 2e-2)


def rank_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def test_the_cli_quantizes_each_rank_and_records_the_precision(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = {}
    for precision in ("fp32", "int8", "int4"):
        flags = [] if precision == "fp32" else ["--quantize", precision, "--block-size", "16"]
        out = tmp_path / precision
        args = ["export", "hf", str(checkpoints["llama"]), "--out", str(out), "--rank-size", "2"]
        assert main([*args, *flags]) == 0
        group = load_group(out, "llama", 1)
        origin = json.loads((out / "llama/1/group.json").read_text())["origin"]
        assert origin.get("quantize") == (None if precision == "fp32" else precision)
        sizes[precision] = rank_bytes(out / "llama/1/rank_0")
        assert group.ranks[0].checksum != group.ranks[1].checksum
    # The embedding table (256 x 64 fp32) stays: the linear layers shrink ~4x and ~8x.
    assert sizes["int4"] < sizes["int8"] < 0.7 * sizes["fp32"]
    assert "rank 0/2: wrote" in capsys.readouterr().err


def test_a_bad_block_size_is_a_usage_error(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["export", "hf", str(checkpoints["llama"]), "--out", str(tmp_path)]
    assert main([*args, "--quantize", "int4", "--block-size", "48"]) == 2
    assert "block size must be a power of two >= 16, got 48" in capsys.readouterr().err
    assert not (tmp_path / "llama").exists()


def test_int4_mixed_keeps_the_mlp_down_projection_and_the_head_at_8_bits(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["llama"], tmp_path, name="mixed", quantize=QuantizeSpec("int4-mixed", 16))
    formats: dict[str, set[tuple[int, int]]] = {}
    for path in sorted((tmp_path / "mixed/1/rank_0").glob("*.onnx")):
        for node in onnx.load(path).graph.node:
            if node.op_type == "MatMulNBits":
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                weight = node.input[1].split(".")[0]
                formats.setdefault(weight, set()).add((attrs["bits"], attrs["block_size"]))
    assert formats == {
        "qkv": {(4, 16)},
        "o_proj": {(4, 16)},
        "mlp_in": {(4, 16)},
        "mlp_out": {(8, 32)},
        "lm_head": {(8, 32)},
    }
