"""A GGUF file's Q8_0/Q4_0 linear weights exported with ``--quantize`` of the same bits and
blocks of 32: each rank's ``MatMulNBits`` holds the file's own blocks for its slice, byte for
byte (no second rounding), and the served model computes the dequantized file exactly
(accuracy level 0) with transformers' greedy ids (transformers dequantizes the same file)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from hf_checkpoints import reference_logits
from hf_runner import PackedModel
from onnx import numpy_helper

from shardserve.tools.export.gguf import export_gguf
from shardserve.tools.export.gguf.blocks import exact_blocks
from shardserve.tools.export.gguf.config import decoder_config
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.gguf.tensors import GgufTensors, hf_to_gguf_name, unpermute_rows
from shardserve.tools.export.hf.weights import weight_source
from shardserve.tools.quantize import QuantizeSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
PRECISION = {"llama-q8_0": "int8", "llama-q4_0": "int4"}
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16  # the tiny Llama (tests/fixtures/hf/llama)


def gguf_blocks(file: GgufFile, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(packed [N, K/32, bytes], scales [N, K/32]) of HF weight ``name`` in HF row order."""
    tensor = file.tensors[hf_to_gguf_name(name)]
    n, k = (int(d) for d in reversed(tensor.shape))
    blocks = exact_blocks(gguf.GGMLQuantizationType(tensor.tensor_type), tensor.data, n, k)
    packed, scales = blocks.packed, blocks.scales.reshape(n, -1)
    heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.split(".")[-2])
    if heads:  # llama.cpp permuted these rows; the Hugging Face graph wants them back
        packed, scales = unpermute_rows(packed, heads), unpermute_rows(scales, heads)
    return packed, scales


def expected_rank_blocks(file: GgufFile, rank: int, ranks: int) -> dict[str, list[tuple]]:
    """Per fused weight (the exporter's initializer hints), per layer: the rank's part."""

    def part(n: int) -> slice:
        return slice(rank * n // ranks, (rank + 1) * n // ranks)

    def rows(name: str, width: int) -> tuple[np.ndarray, np.ndarray]:
        packed, scales = gguf_blocks(file, name)
        return packed[part(width)], scales[part(width)]

    def cols(name: str, width: int) -> tuple[np.ndarray, np.ndarray]:
        packed, scales = gguf_blocks(file, name)
        return packed[:, part(width // 32)], scales[:, part(width // 32)]

    def stacked(*pieces: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([p for p, _ in pieces]), np.concatenate([s for _, s in pieces])

    out: dict[str, list[tuple]] = {"qkv": [], "o_proj": [], "mlp_in": [], "mlp_out": []}
    for layer in range(LAYERS):
        b = f"model.layers.{layer}."
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        attn = [
            rows(f"{b}self_attn.{n}.weight", w)
            for n, w in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        ]
        out["qkv"].append(stacked(*attn))
        out["o_proj"].append(cols(f"{b}self_attn.o_proj.weight", q))
        out["mlp_in"].append(
            stacked(rows(f"{b}mlp.gate_proj.weight", 128), rows(f"{b}mlp.up_proj.weight", 128))
        )
        out["mlp_out"].append(cols(f"{b}mlp.down_proj.weight", 128))
    out["lm_head"] = [rows("lm_head.weight", 512)]
    return out


def exported_rank_blocks(rank_dir: Path) -> dict[str, list[tuple]]:
    """The rank's MatMulNBits initializers by weight hint, in program order."""
    found: dict[str, list[tuple]] = {}
    files = sorted(rank_dir.glob("segment*.onnx"), key=lambda p: int(p.stem[7:]))
    for path in files:
        model = onnx.load(path)
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "MatMulNBits":
                hint = node.input[1].split(".")[0]
                scales = inits[node.input[2]].reshape(inits[node.input[1]].shape[:2])
                found.setdefault(hint, []).append((inits[node.input[1]], scales))
    return found


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", sorted(PRECISION))
def test_each_rank_holds_the_files_blocks_byte_for_byte(
    name: str, ranks: int, tmp_path: Path
) -> None:
    spec = QuantizeSpec(PRECISION[name], 32, accuracy_level=0)
    export_gguf(FIXTURES / f"{name}.gguf", tmp_path, rank_size=ranks, name="m", quantize=spec)
    file = GgufFile(FIXTURES / f"{name}.gguf")
    for rank in range(ranks):
        got = exported_rank_blocks(tmp_path / "m" / "1" / f"rank_{rank}")
        want = expected_rank_blocks(file, rank, ranks)
        assert sorted(got) == sorted(want)
        for hint, parts in want.items():
            assert len(got[hint]) == len(parts), hint
            for (packed, scales), (want_packed, want_scales) in zip(got[hint], parts, strict=True):
                assert packed.tobytes() == want_packed.tobytes(), (hint, rank)
                assert scales.tobytes() == want_scales.astype(np.float32).tobytes(), (hint, rank)


def dequantized_reference(name: str, ids: list[int]) -> np.ndarray:
    """float64 numpy forward of the file's weights dequantized by the ``gguf`` package."""
    file = GgufFile(FIXTURES / f"{name}.gguf")
    config = decoder_config(file)
    tensors = GgufTensors(file, config)
    weights = {n: tensors.read(n) for n in weight_source(tensors, config).shapes}
    llama = {
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
    }
    return reference_logits("llama", weights, ids, head=weights["lm_head.weight"], config=llama)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", sorted(PRECISION))
def test_kept_blocks_compute_the_dequantized_file(name: str, ranks: int, tmp_path: Path) -> None:
    spec = QuantizeSpec(PRECISION[name], 32, accuracy_level=0)
    export_gguf(FIXTURES / f"{name}.gguf", tmp_path, rank_size=ranks, name="m", quantize=spec)
    model = PackedModel(tmp_path, "m")
    reference = json.loads((FIXTURES / f"{name}.json").read_text())
    for index, prompt in enumerate(reference["prompts"]):
        ids = prompt["input_ids"]
        tokens, logits = model.generate(index, ids, len(prompt["greedy_ids"]))
        want = dequantized_reference(name, ids)
        assert np.abs(logits[0] - want).max() <= 1e-4 * np.abs(want).max()
        assert tokens == prompt["greedy_ids"], index


def test_a_k_split_off_block_bounds_is_re_quantized_and_said(tmp_path: Path) -> None:
    """At TP 4 each rank's 16 columns of o_proj split the file's 32-value blocks: that
    weight is rounded again from fp32 (and the export says so); the others stay kept."""
    lines: list[str] = []
    spec = QuantizeSpec("int8", 32, accuracy_level=0)
    export_gguf(
        FIXTURES / "llama-q8_0.gguf",
        tmp_path,
        rank_size=4,
        name="m",
        quantize=spec,
        progress=lines.append,
    )
    assert any(
        "attn_output.weight: this rank's columns 16:32 split blocks of 32" in line for line in lines
    )
    file = GgufFile(FIXTURES / "llama-q8_0.gguf")
    got = exported_rank_blocks(tmp_path / "m" / "1" / "rank_1")
    packed, _ = gguf_blocks(file, "model.layers.0.mlp.down_proj.weight")
    assert got["mlp_out"][0][0].tobytes() == packed[:, 1:2].tobytes()
    scales = got["o_proj"][0][1]  # 16 values: one (padded) block with its own new scale
    assert scales.shape == (64, 1)
    assert not np.array_equal(
        scales[:, 0], gguf_blocks(file, "model.layers.0.self_attn.o_proj.weight")[1][:, 0]
    )
