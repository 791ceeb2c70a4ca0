"""generation_config.json's sampling defaults (shardserve.text.generation_defaults) and how the
scheduler applies them and the request's own fields (decoding): do_sample false is greedy, a
request's field wins, max_tokens left out fills the context, one beyond it is a 400 naming it,
logit_bias ids outside the vocabulary are a 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.errors import BadInputError
from shardserve.text.generation_defaults import SamplingDefaults
from shardserve.text.tokenizer import TextModel
from shardserve.wire.protocol import LogitBias, SamplingParams
from shardserve_scheduler.core.generation.decoding import decoding

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "llama"


def test_do_sample_false_is_greedy_whatever_the_temperature() -> None:
    config = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    defaults = SamplingDefaults.from_config(config)
    assert defaults == SamplingDefaults(temperature=0.0, top_p=0.9, repetition_penalty=1.1)


def test_sampling_defaults_are_the_fields_the_file_sets_in_range() -> None:
    config = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 1.5}
    assert SamplingDefaults.from_config(config) == SamplingDefaults(temperature=0.7, top_k=20)
    assert SamplingDefaults.from_config({}) == SamplingDefaults()
    assert SamplingDefaults.from_config({"temperature": True, "top_k": -1}) == SamplingDefaults()


@pytest.fixture(scope="module")
def text() -> TextModel:
    return TextModel.load(FIXTURE, "llama", 512)


def test_the_fixture_says_greedy_and_a_request_field_wins(text: TextModel) -> None:
    assert text.sampling_defaults.temperature == 0.0  # its generation_config: do_sample false
    omitted = decoding(SamplingParams(), text, (1, 2, 3), 128)
    assert omitted.row.temperature == 0.0 and omitted.row.top_p == 1.0
    given = decoding(SamplingParams(temperature=0.8, top_k=5), text, (1, 2, 3), 128)
    assert (given.row.temperature, given.row.top_k) == (0.8, 5)


def test_max_tokens_left_out_fills_the_context_and_beyond_it_is_refused(text: TextModel) -> None:
    assert decoding(SamplingParams(), text, (1,) * 100, 128).max_tokens == 28
    assert decoding(SamplingParams(max_tokens=28), text, (1,) * 100, 128).max_tokens == 28
    with pytest.raises(BadInputError, match=r"^max_tokens is 29, .* at most 28 tokens"):
        decoding(SamplingParams(max_tokens=29), text, (1,) * 100, 128)


def test_logit_bias_outside_the_vocabulary_is_refused(text: TextModel) -> None:
    bias = (LogitBias(token_id=512, bias=1.0),)
    with pytest.raises(BadInputError, match=r"logit_bias names token 512, outside .*\[0, 512\)"):
        decoding(SamplingParams(logit_bias=bias), text, (1,), 128)


def test_min_tokens_masks_eos_and_stop_ids_in_the_vocabulary(text: TextModel) -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(7, 9000))
    assert decoding(params, text, (1,), 128).row.masked_until_min == (1, 4, 7)  # EOS 1 and 4
    no_eos = params.model_copy(update={"ignore_eos": True})
    assert decoding(no_eos, text, (1,), 128).row.masked_until_min == (7,)
    assert decoding(SamplingParams(stop_token_ids=(7,)), text, (1,), 128).row.masked_until_min == ()


def test_the_prompt_goes_along_only_for_a_repetition_penalty(text: TextModel) -> None:
    prompt = (5, 3, 5, 9)
    assert decoding(SamplingParams(), text, prompt, 128).row.prompt_ids == ()
    penalized = decoding(SamplingParams(repetition_penalty=1.2), text, prompt, 128)
    assert penalized.row.prompt_ids == (3, 5, 9)
