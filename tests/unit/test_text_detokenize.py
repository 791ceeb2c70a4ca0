"""Incremental detokenizing (shardserve.text.detokenize) with the fixtures' real tokenizers:
joined deltas equal the full decode (special tokens skipped) for any ids fed in any chunks,
and a character whose UTF-8 bytes span tokens is never sent in pieces."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.text.detokenize import REPLACEMENT_CHARACTER, IncrementalDetokenizer
from shardserve.text.tokenizer import TextModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
MODELS = ("gpt2", "llama", "qwen2", "mistral")
# The fixtures' training text has these; their bytes stay split over several tokens.
MULTIBYTE = "Renée's café — 日本の夏 🌸 is lovely; crème brûlée 😀 🍣 Zürich Tōkyō naïve"


@cache
def text_model(model: str) -> TextModel:
    return TextModel.load(FIXTURES / model, servable=model)


def stream(text: TextModel, ids: list[int], chunks: list[int]) -> list[str]:
    """Push ``ids`` in chunks of the given sizes (cycled); return every delta, finish's last."""
    detokenizer = text.detokenizer()
    deltas, position, turn = [], 0, 0
    while position < len(ids):
        size = chunks[turn % len(chunks)] if chunks else 1
        deltas.append(detokenizer.push(ids[position : position + size]))
        position, turn = position + size, turn + 1
    deltas.append(detokenizer.finish())
    return deltas


def chunk_sizes() -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, 4), min_size=1, max_size=8)


@pytest.mark.parametrize("model", MODELS)
@given(data=st.data(), chunks=chunk_sizes())
@settings(max_examples=150, deadline=None)
def test_joined_deltas_are_the_full_decode_of_random_ids(
    model: str, data: st.DataObject, chunks: list[int]
) -> None:
    text = text_model(model)
    ids = data.draw(st.lists(st.integers(0, text.vocab_size - 1), max_size=40))
    assert "".join(stream(text, ids, chunks)) == text.decode(ids)


@pytest.mark.parametrize("model", MODELS)
@given(
    fragment=st.text(alphabet=st.sampled_from(sorted(set(MULTIBYTE))), max_size=30),
    chunks=chunk_sizes(),
)
@settings(max_examples=100, deadline=None)
def test_streamed_multibyte_text_comes_out_whole(
    model: str, fragment: str, chunks: list[int]
) -> None:
    text = text_model(model)
    ids = text.encode(fragment)
    deltas = stream(text, ids, chunks)
    assert "".join(deltas) == text.decode(ids) == fragment
    # A valid text never needs U+FFFD: every character arrives whole, in one delta.
    assert all(REPLACEMENT_CHARACTER not in delta for delta in deltas)


@pytest.mark.parametrize("model", MODELS)
def test_the_references_continuations_stream_to_their_text(model: str) -> None:
    text = text_model(model)
    for prompt in json.loads((FIXTURES / model / "reference.json").read_text())["prompts"]:
        # greedy_text was decoded by transformers without skipping: no special token is in it.
        assert "".join(stream(text, prompt["greedy_ids"], [1])) == prompt["greedy_text"]


def test_incomplete_bytes_are_held_until_the_character_completes() -> None:
    text = text_model("llama")
    ids = text.encode("日本")[1:]  # without the BOS
    assert len(ids) > 2  # the two characters' six bytes span several tokens
    detokenizer = text.detokenizer()
    deltas = [detokenizer.push([token]) for token in ids]
    assert "".join(deltas) == "日本"
    assert all(delta in ("", "日", "本", "日本") for delta in deltas)
    assert deltas[0] == ""  # the first token is a lone lead byte
    assert detokenizer.text == "日本" and detokenizer.ids == tuple(ids)
    assert detokenizer.finish() == ""


def test_finish_flushes_a_character_cut_short() -> None:
    text = text_model("llama")
    lead_byte = text.encode("日")[1]
    detokenizer = text.detokenizer()
    assert detokenizer.push(text.encode("ok")[1:]) == "ok"
    assert detokenizer.push([lead_byte]) == ""
    assert detokenizer.finish() == REPLACEMENT_CHARACTER


def test_special_tokens_are_skipped() -> None:
    text = text_model("llama")
    eot = text.token_id("<|eot_id|>")
    assert eot is not None
    detokenizer = text.detokenizer()
    assert detokenizer.push(text.encode("Hi")) == "Hi"  # the BOS is special too
    assert detokenizer.push([eot]) == ""
    assert detokenizer.push(text.encode(" there")[1:]) == " there"


def test_a_decoder_that_strips_a_leading_space_keeps_inner_spaces() -> None:
    """The window decode (not token by token) keeps what a Metaspace decoder does at the start."""
    pieces = {1: "▁Hello", 2: "▁world", 3: "!"}

    def decode(ids: object) -> str:
        joined = "".join(pieces[i] for i in ids)  # type: ignore[attr-defined]
        return joined.replace("▁", " ").removeprefix(" ")

    detokenizer = IncrementalDetokenizer(decode)
    assert [detokenizer.push([i]) for i in (1, 2, 3)] == ["Hello", " world", "!"]
    assert detokenizer.finish() == ""
