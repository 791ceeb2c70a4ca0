"""``export_gguf``: the committed tiny GGUF files (tests/fixtures/gguf, written from the
Hugging Face fixtures by make_fixtures.py) exported per rank and run with real onnxruntime,
against what transformers loading the same files computed (greedy ids, tokenizer ids)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from hf_runner import PackedModel

from shardserve.errors import ExportError
from shardserve.repo.repository import load_group
from shardserve.text.tokenizer import TextModel
from shardserve.tools.export.gguf import default_name, export_gguf
from shardserve.tools.export.gguf.config import context_limit
from shardserve.tools.export.gguf.file import GgufFile
from shardserve.tools.export.gguf.tensors import unpermute_rows
from shardserve.tools.export.gguf.tokenizer import merges_from_scores

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.gguf"))


def reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_fixture_has_its_reference() -> None:
    assert len(NAMES) == 7
    for name in NAMES:
        assert reference(name)["prompts"]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_ids_equal_transformers(name: str, ranks: int, tmp_path: Path) -> None:
    """Every type in the fixtures is served as transformers computes the file: F32 as it
    is, Q8_0 and Q4_0 as the file's own blocks (MatMulNBits at accuracy level 0: fp32
    activations, the dequantized weights exactly), so the greedy continuations are
    transformers' at every tensor-parallel degree."""
    export_gguf(FIXTURES / f"{name}.gguf", tmp_path, rank_size=ranks, name="m", accuracy_level=0)
    model = PackedModel(tmp_path, "m")
    for index, prompt in enumerate(reference(name)["prompts"]):
        assert prompt["min_top1_margin"] > 5e-4  # no near-tie decides this test
        tokens, _ = model.generate(index, prompt["input_ids"], len(prompt["greedy_ids"]))
        assert tokens == prompt["greedy_ids"], (name, index)


@pytest.mark.parametrize("name", ["llama-f32", "qwen2-f32", "mistral-f32"])
def test_tokenizer_ids_equal_transformers(name: str, tmp_path: Path) -> None:
    """Byte-level BPE (llama-bpe and qwen2 splits) and SentencePiece BPE (merges recovered
    from scores, byte fallback): prompt ids, chat ids and decoded text as transformers."""
    export_gguf(FIXTURES / f"{name}.gguf", tmp_path, name="m")
    ref = reference(name)
    text = TextModel.load(tmp_path / "m" / "1" / "tokenizer", servable="m", model_vocab=512)
    for sample in ref["texts"]:
        assert text.encode(sample["text"]) == sample["ids"], sample["text"]
    for prompt in ref["prompts"]:
        assert text.encode(prompt["text"]) == prompt["input_ids"]
        assert text.decode(prompt["greedy_ids"]) == prompt["greedy_text"]
    assert text.render_chat(ref["chat"]["messages"]) == ref["chat"]["text"]
    assert text.encode_chat(ref["chat"]["messages"]) == ref["chat"]["input_ids"]


def test_group_records_where_it_came_from(tmp_path: Path) -> None:
    group = export_gguf(FIXTURES / "qwen2-q4_0.gguf", tmp_path, rank_size=2)
    assert group.servable == "qwen2-q4_0"
    loaded = load_group(tmp_path, "qwen2-q4_0", 1)
    assert loaded.origin["model"] == "gguf"
    assert loaded.origin["architecture"] == "Qwen2ForCausalLM"
    assert loaded.origin["task"] == "text-generation"
    files = sorted(p.name for p in (tmp_path / "qwen2-q4_0" / "1" / "tokenizer").iterdir())
    assert files == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_mistral_named_file_is_called_mistral(tmp_path: Path) -> None:
    export_gguf(FIXTURES / "mistral-q8_0.gguf", tmp_path, name="m")
    assert load_group(tmp_path, "m", 1).origin["architecture"] == "MistralForCausalLM"


def test_default_name_drops_the_quantization_suffix() -> None:
    assert default_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct"
    assert default_name(Path("llama-f32.gguf")) == "llama-f32"
    assert default_name(Path("model.v2.gguf")) == "model.v2"


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    heads = 2
    permuted = (
        weight.reshape(heads, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)
    )  # llama.cpp's convert_hf_to_gguf permute
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), weight)
    assert not np.array_equal(permuted, weight)


def test_merges_from_scores_rank_by_the_merged_token() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5]
    assert merges_from_scores(tokens, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


def _write(path: Path, arch: str, **extra: object) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(str(extra.get("tokenizer", "gpt2")))
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ExportError, match="architecture 'phi3' is not supported; supported: llama"):
        export_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ExportError, match="is not a readable GGUF file"):
        export_gguf(path, tmp_path / "out")
    with pytest.raises(ExportError, match="does not exist"):
        export_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_missing_metadata_and_tensors_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "bare.gguf", "llama")
    with pytest.raises(ExportError, match="no metadata key 'llama.embedding_length'"):
        export_gguf(path, tmp_path / "out")


def test_truncated_fixture_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    data = (FIXTURES / "llama-q8_0.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError):
        export_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _with_context(path: Path, context: int, window: int | None) -> GgufFile:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufFile(path)


def test_a_sliding_window_caps_the_context(tmp_path: Path) -> None:
    """Full attention is exact only inside the window (Mistral v0.1's 4096 of 32768)."""
    assert context_limit(_with_context(tmp_path / "w.gguf", 32768, 4096), "llama") == 4096
    assert context_limit(_with_context(tmp_path / "n.gguf", 2048, None), "llama") == 2048
    assert context_limit(_with_context(tmp_path / "l.gguf", 2048, 4096), "llama") == 2048
