"""The Hugging Face fixtures (tests/fixtures/hf) are what the exporter and the server are checked
against: these tests hold them to what their README promises, without torch or transformers.

The key check is that the `tokenizers` package alone gives the ids and texts transformers gave:
serving tokenizes with it, and the references are only worth something for the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NEW_TOKENS = 24
MIN_MARGIN = 1e-2
MAX_FIXTURES_BYTES = 6_000_000

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "reference.json",
    "reference.safetensors",
)


@dataclass(frozen=True)
class Expected:
    """What each fixture is there to cover."""

    architecture: str
    weight_files: int
    tied_head: bool
    vocab_divisible_by_4: bool
    chat: bool
    eos_ids_in_generation_config: int


EXPECTED = {
    "gpt2": Expected("GPT2LMHeadModel", 1, True, False, False, 1),
    "llama": Expected("LlamaForCausalLM", 2, False, True, True, 2),
    "qwen2": Expected("Qwen2ForCausalLM", 1, True, True, True, 1),
    "mistral": Expected("MistralForCausalLM", 1, False, True, True, 1),
}
MODELS = tuple(EXPECTED)


@cache
def read_json(model: str, name: str) -> Any:
    return json.loads((FIXTURES_DIR / model / name).read_text(encoding="utf-8"))


def reference(model: str) -> Any:
    return read_json(model, "reference.json")


def config(model: str) -> Any:
    return read_json(model, "config.json")


@cache
def arrays(model: str) -> dict[str, np.ndarray]:
    return load_file(str(FIXTURES_DIR / model / "reference.safetensors"))


@cache
def tokenizer(model: str) -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURES_DIR / model / "tokenizer.json"))


def weight_shapes(model: str) -> dict[str, list[int]]:
    """Every tensor of the checkpoint, by name, as the safetensors headers declare it."""
    shapes: dict[str, list[int]] = {}
    for path in sorted((FIXTURES_DIR / model).glob("model*.safetensors")):
        with safe_open(str(path), framework="np") as weights:
            for name in weights.keys():
                shapes[name] = list(weights.get_slice(name).get_shape())
    return shapes


def vocab_size(model: str) -> int:
    return int(config(model)["vocab_size"])


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("model", MODELS)
def test_folder_holds_a_checkpoint_as_save_pretrained_writes_it(model: str) -> None:
    folder = FIXTURES_DIR / model
    missing = [name for name in CHECKPOINT_FILES if not (folder / name).is_file()]
    assert missing == []
    assert config(model)["architectures"] == [EXPECTED[model].architecture]


@pytest.mark.parametrize("model", MODELS)
def test_weights_are_in_the_expected_number_of_files(model: str) -> None:
    folder = FIXTURES_DIR / model
    files = sorted(path.name for path in folder.glob("model*.safetensors"))
    assert len(files) == EXPECTED[model].weight_files
    if len(files) > 1:
        index = read_json(model, "model.safetensors.index.json")
        assert sorted(set(index["weight_map"].values())) == files
        assert sorted(index["weight_map"]) == sorted(weight_shapes(model))


@pytest.mark.parametrize("model", MODELS)
def test_embedding_and_head_shapes_follow_the_config(model: str) -> None:
    shapes = weight_shapes(model)
    hidden = config(model).get("hidden_size") or config(model)["n_embd"]
    embedding = "transformer.wte.weight" if model == "gpt2" else "model.embed_tokens.weight"
    assert shapes[embedding] == [vocab_size(model), hidden]
    assert ("lm_head.weight" not in shapes) == EXPECTED[model].tied_head
    assert (vocab_size(model) % 4 == 0) == EXPECTED[model].vocab_divisible_by_4


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
def test_attention_is_grouped_query(model: str) -> None:
    cfg = config(model)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    shapes = weight_shapes(model)
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [
        cfg["num_attention_heads"] * head_dim,
        cfg["hidden_size"],
    ]
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [
        cfg["num_key_value_heads"] * head_dim,
        cfg["hidden_size"],
    ]
    has_bias = "model.layers.0.self_attn.q_proj.bias" in shapes
    assert has_bias == (model == "qwen2")


@pytest.mark.parametrize("model", MODELS)
def test_generation_config_is_greedy_with_eos_ids(model: str) -> None:
    generation = read_json(model, "generation_config.json")
    eos = generation["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    assert len(eos_ids) == EXPECTED[model].eos_ids_in_generation_config
    assert generation["do_sample"] is False
    assert all(0 <= token < tokenizer(model).get_vocab_size() for token in eos_ids)


def test_fixtures_stay_small() -> None:
    size = sum(path.stat().st_size for path in FIXTURES_DIR.rglob("*") if path.is_file())
    assert size < MAX_FIXTURES_BYTES


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("model", MODELS)
def test_tokenizers_package_gives_transformers_ids(model: str) -> None:
    for prompt in reference(model)["prompts"]:
        assert tokenizer(model).encode(prompt["text"]).ids == prompt["input_ids"], prompt["text"]


@pytest.mark.parametrize("model", MODELS)
def test_tokenizers_package_decodes_like_transformers(model: str) -> None:
    for case in reference(model)["decodes"]:
        text = tokenizer(model).decode(case["ids"], skip_special_tokens=case["skip_special_tokens"])
        assert text == case["text"], case


@pytest.mark.parametrize("model", MODELS)
def test_some_multibyte_character_spans_tokens(model: str) -> None:
    """A detokenizer that streams must hold back partial characters: the fixtures have one."""
    texts = [case["text"] for case in reference(model)["decodes"]]
    assert any(text.endswith("\ufffd") for text in texts)
    assert any(not text.isascii() for text in (p["text"] for p in reference(model)["prompts"]))


@pytest.mark.parametrize("model", [m for m in MODELS if EXPECTED[m].chat])
def test_chat_ids_are_the_rendered_text_encoded_without_added_specials(model: str) -> None:
    chat = reference(model)["chat"]
    assert isinstance(read_json(model, "tokenizer_config.json")["chat_template"], str)
    assert tokenizer(model).encode(chat["text"], add_special_tokens=False).ids == chat["input_ids"]


def test_gpt2_has_no_chat_template() -> None:
    assert "chat_template" not in read_json("gpt2", "tokenizer_config.json")
    assert reference("gpt2")["chat"] is None


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("model", MODELS)
def test_reference_arrays_have_the_shapes_the_config_implies(model: str) -> None:
    expected: dict[str, tuple[int, ...]] = {}
    for index, prompt in enumerate(reference(model)["prompts"]):
        expected[f"prompt{index}.prefill_logits"] = (len(prompt["input_ids"]), vocab_size(model))
        expected[f"prompt{index}.decode_logits"] = (NEW_TOKENS, vocab_size(model))
    found = arrays(model)
    assert {name: found[name].shape for name in found} == expected
    assert all(found[name].dtype == np.float32 for name in found)
    assert all(np.isfinite(found[name]).all() for name in found)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_are_the_argmax_of_the_decode_logits(model: str) -> None:
    for index, prompt in enumerate(reference(model)["prompts"]):
        decode = arrays(model)[f"prompt{index}.decode_logits"]
        prefill = arrays(model)[f"prompt{index}.prefill_logits"]
        # np.argmax takes the lowest index on ties, as torch.argmax does.
        assert np.argmax(decode, axis=-1).tolist() == prompt["greedy_ids"]
        np.testing.assert_array_equal(decode[0], prefill[-1])  # token 0 comes from the prefill


@pytest.mark.parametrize("model", MODELS)
def test_every_greedy_step_has_a_clear_top1_margin(model: str) -> None:
    for index in range(len(reference(model)["prompts"])):
        top_two = np.sort(arrays(model)[f"prompt{index}.decode_logits"], axis=-1)[:, -2:]
        assert float((top_two[:, 1] - top_two[:, 0]).min()) > MIN_MARGIN


@pytest.mark.parametrize("model", MODELS)
def test_continuations_are_varied_and_decode_to_the_recorded_text(model: str) -> None:
    for prompt in reference(model)["prompts"]:
        assert len(prompt["greedy_ids"]) == NEW_TOKENS
        assert len(set(prompt["greedy_ids"])) >= 5
        decoded = tokenizer(model).decode(prompt["greedy_ids"], skip_special_tokens=False)
        assert decoded == prompt["greedy_text"]
