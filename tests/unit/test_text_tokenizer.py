"""TextModel (shardserve.text.tokenizer) against transformers' own results for the committed
fixtures (tests/fixtures/hf/*/reference.json): prompt ids, decodes, chat renderings and chat
ids are reproduced exactly, without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardserve.errors import BadInputError, RepositoryError
from shardserve.text.tokenizer import TextModel
from shardserve.wire.protocol import ChatMessage, TokenLogprob, TopLogprob

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
MODELS = ("gpt2", "llama", "qwen2", "mistral")
CHAT_MODELS = ("llama", "qwen2", "mistral")
# The exported version folder's tokenizer/ holds these (shardserve.tools.export.hf.export).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def reference(model: str) -> Any:
    return json.loads((FIXTURES / model / "reference.json").read_text(encoding="utf-8"))


def text_model(model: str, **kwargs: Any) -> TextModel:
    return TextModel.load(FIXTURES / model, servable=model, **kwargs)


@pytest.mark.parametrize("model", MODELS)
def test_prompt_ids_are_transformers_ids(model: str) -> None:
    text = text_model(model)
    for prompt in reference(model)["prompts"]:
        assert text.encode(prompt["text"]) == prompt["input_ids"]


@pytest.mark.parametrize("model", MODELS)
def test_decodes_are_transformers_decodes(model: str) -> None:
    text = text_model(model)
    for case in reference(model)["decodes"]:
        assert text.decode(case["ids"], case["skip_special_tokens"]) == case["text"]
    for prompt in reference(model)["prompts"]:
        assert text.decode(prompt["greedy_ids"], skip_special_tokens=False) == prompt["greedy_text"]


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_chat_is_rendered_and_encoded_as_transformers_does(model: str) -> None:
    chat = reference(model)["chat"]
    text = text_model(model)
    assert chat["add_generation_prompt"] is True
    assert text.has_chat_template
    assert text.render_chat(chat["messages"]) == chat["text"]
    assert text.encode_chat(chat["messages"]) == chat["input_ids"]


def test_a_servable_without_chat_template_answers_400_naming_it() -> None:
    text = text_model("gpt2")
    assert not text.has_chat_template
    with pytest.raises(BadInputError, match="servable gpt2 has no chat template") as caught:
        text.encode_chat([{"role": "user", "content": "hi"}])
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("model", "eos"), [("gpt2", (0,)), ("llama", (1, 4)), ("qwen2", (2,)), ("mistral", (2,))]
)
def test_eos_ids_come_from_generation_config(model: str, eos: tuple[int, ...]) -> None:
    generation = json.loads((FIXTURES / model / "generation_config.json").read_text())
    listed = generation["eos_token_id"]
    assert eos == (tuple(listed) if isinstance(listed, list) else (listed,))
    assert text_model(model).eos_token_ids == eos


def exported_tokenizer(model: str, target: Path, drop: tuple[str, ...] = ()) -> Path:
    """A version folder's tokenizer/ as the exporter writes it (minus ``drop``)."""
    folder = target / "1" / "tokenizer"
    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if name not in drop:
            shutil.copyfile(FIXTURES / model / name, folder / name)
    return folder


def test_eos_falls_back_to_the_configs_eos_token(tmp_path: Path) -> None:
    folder = exported_tokenizer("qwen2", tmp_path, drop=("generation_config.json",))
    text = TextModel.load(folder, servable="qwen2")
    assert text.eos_token_ids == (text.token_id("<|im_end|>"),) == (2,)


def test_an_exported_tokenizer_folder_loads_and_encodes_alike(tmp_path: Path) -> None:
    folder = exported_tokenizer("llama", tmp_path)
    prompt = reference("llama")["prompts"][1]
    assert TextModel.load(folder).encode(prompt["text"]) == prompt["input_ids"]


def test_a_folder_without_tokenizer_json_is_a_repository_error(tmp_path: Path) -> None:
    folder = exported_tokenizer("llama", tmp_path, drop=("tokenizer.json",))
    with pytest.raises(RepositoryError, match="no tokenizer.json"):
        TextModel.load(folder, servable="llama")


def test_a_broken_config_file_is_a_repository_error(tmp_path: Path) -> None:
    folder = exported_tokenizer("llama", tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(RepositoryError, match="tokenizer_config.json"):
        TextModel.load(folder)


def test_vocab_size_is_the_models_when_given() -> None:
    assert text_model("gpt2").vocab_size == 387
    assert text_model("llama", model_vocab=600).vocab_size == 600


@pytest.mark.parametrize("bad", [-1, 512, 10**9])
def test_ids_outside_the_vocabulary_are_bad_input(bad: int) -> None:
    text = text_model("llama")
    text.check_ids([0, 5, 511])
    with pytest.raises(BadInputError, match=rf"prompt token 1 of servable llama is {bad}"):
        text.check_ids([3, bad, 4])


def test_token_text_shows_special_tokens_and_partial_bytes() -> None:
    text = text_model("llama")
    assert text.token_text(1) == "<|end_of_text|>"
    assert text.token_text(text.encode("The")[1]) == "The"
    partial = reference("llama")["decodes"][-1]["ids"][-1]  # the first byte of "日"
    assert text.decode([partial]) == "\ufffd"
    assert text.token_text(partial) == "æ"  # byte 0xE6 in the byte-level alphabet
    assert text.token_text(10**6) == ""  # an id the tokenizer does not have


def test_the_tokenizer_adds_bos_only_where_transformers_does() -> None:
    assert text_model("llama").encode("hi")[0] == 0  # <|begin_of_text|>
    assert text_model("mistral").encode("hi")[0] == 1  # <s>
    assert text_model("qwen2").encode("") == []


def test_chat_messages_may_be_wire_models() -> None:
    chat = reference("qwen2")["chat"]
    messages = [ChatMessage(**message) for message in chat["messages"]]
    assert text_model("qwen2").encode_chat(messages) == chat["input_ids"]


def test_logprob_texts_are_filled_from_the_tokenizer() -> None:
    text = text_model("llama")
    the = text.encode("The")[1]
    agent = TokenLogprob(
        token_id=the, text="", logprob=-0.5, top=(TopLogprob(token_id=1, text="", logprob=-1.0),)
    )
    filled = text.with_texts(agent)
    assert filled.text == "The" and filled.logprob == -0.5
    assert [(t.token_id, t.text, t.logprob) for t in filled.top] == [(1, "<|end_of_text|>", -1.0)]


@pytest.mark.parametrize("model", MODELS)
def test_byte_tokens_keep_distinct_texts_for_logprobs(model: str) -> None:
    """A token that is part of a character decodes alone to U+FFFD; its logprob text is its
    vocabulary entry instead, so top alternatives never collapse into one text."""
    text = text_model(model)
    partial = [
        i for i in range(text.vocab_size) if "\ufffd" in text.decode([i], skip_special_tokens=False)
    ]
    assert len(partial) > 100  # the byte-level alphabet's non-ASCII half
    texts = [text.token_text(i) for i in partial]
    assert len(set(texts)) == len(partial) and not any("\ufffd" in t for t in texts)
    whole = next(i for i in range(text.vocab_size) if i not in partial and text.decode([i]))
    assert text.token_text(whole) == text.decode([whole], skip_special_tokens=False)
