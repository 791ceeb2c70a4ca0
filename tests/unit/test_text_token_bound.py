"""The token count bound (shardserve.text.token_bound): never above what the tokenizer gives,
for every fixture's tokenizer and any text; a prompt past it refused without tokenizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.errors import BadInputError
from shardserve.text.token_bound import most_bytes_per_token, prompt_bytes_limit
from shardserve.text.tokenizer import TextModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
MODELS = ("gpt2", "llama", "qwen2", "mistral")
TEXT_MODELS = {model: TextModel.load(FIXTURES / model, servable=model) for model in MODELS}
SPECS = {model: json.loads((FIXTURES / model / "tokenizer.json").read_text()) for model in MODELS}


def fewest(model: str, text: str) -> int:
    per_token = most_bytes_per_token(SPECS[model])
    assert per_token is not None  # every fixture is a byte-level BPE
    return -(-len(text.encode("utf-8")) // per_token)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300) | st.sampled_from(["aaaa" * 50, "hello world " * 30]))
def test_the_bound_is_never_above_the_token_count(model: str, text: str) -> None:
    assert fewest(model, text) <= len(TEXT_MODELS[model].encode(text))


@pytest.mark.parametrize("model", MODELS)
def test_special_tokens_written_in_the_text_count(model: str) -> None:
    specials = [t["content"] for t in SPECS[model].get("added_tokens", [])]
    text = "".join(specials) * 20
    assert fewest(model, text) <= len(TEXT_MODELS[model].encode(text))


def test_a_prompt_past_the_context_is_refused_naming_the_bound() -> None:
    text = TEXT_MODELS["llama"]
    with pytest.raises(BadInputError, match=r"at least \d+ tokens .*context is 128 tokens"):
        text.encode("hello world " * 83333, context=128)
    with pytest.raises(BadInputError, match="context is 128 tokens"):
        text.encode_chat([{"role": "user", "content": "x" * 10_000}], context=128)
    assert text.encode("hello world", context=128) == text.encode("hello world")


@pytest.mark.parametrize("model", MODELS)
def test_the_prompt_bytes_limit_is_where_the_refusal_starts(model: str) -> None:
    per_token = most_bytes_per_token(SPECS[model])
    assert per_token is not None
    limit = prompt_bytes_limit(128, per_token)
    TEXT_MODELS[model].encode("x" * limit, context=128)  # (not refused by the bound)
    with pytest.raises(BadInputError, match="context is 128 tokens"):
        TEXT_MODELS[model].encode("x" * (limit + 1), context=128)


def sentencepiece_like(**changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(SPECS["llama"]))
    spec.update(changes)
    return spec


@pytest.mark.parametrize(
    "changes",
    [
        {"normalizer": {"type": "NFKC"}},  # composing can shrink the text
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}},
        {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}]}},
        {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "behavior": "Removed"},
                    {"type": "ByteLevel"},
                ],
            }
        },
    ],
)
def test_no_bound_where_the_tokenizer_could_shrink_or_drop_text(changes: dict[str, Any]) -> None:
    assert most_bytes_per_token(sentencepiece_like(**changes)) is None


def test_no_bound_for_other_models_or_fused_unknowns() -> None:
    spec = sentencepiece_like()
    spec["model"] = {**spec["model"], "fuse_unk": True}
    assert most_bytes_per_token(spec) is None
    assert most_bytes_per_token(sentencepiece_like(model={"type": "WordPiece"})) is None
