"""Stop conditions: EOS, stop ids, stop strings across chunks, max_tokens, context; the
text of the chunks joined equals the decode, characters split over tokens held back."""

from __future__ import annotations

from test_generation_kit import Bench, request, text_model

EOS = 1  # the llama fixture's generation_config eos ids are 1 and 4


def scripted(tokens: list[int]) -> Bench:
    return Bench(script=lambda seq, index: tokens[index] if index < len(tokens) else 300)


def words(text: str) -> list[int]:
    return text_model().encode(text)[1:]  # without BOS


def test_eos_stops_and_adds_no_text() -> None:
    bench = scripted([*words(" hello"), EOS])
    bench.generate("a", request("a", max_tokens=20))
    bench.run_until_idle()
    last = bench.last("a")
    assert last.finish_reason == "stop" and last.token_ids == (EOS,)
    assert bench.text("a") == text_model().decode(words(" hello"))


def test_ignore_eos_goes_on_to_max_tokens() -> None:
    bench = scripted([EOS, EOS, EOS])
    bench.generate("a", request("a", max_tokens=3, ignore_eos=True))
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"


def test_stop_token_ids() -> None:
    bench = scripted([200, 201, 202, 203])
    bench.generate("a", request("a", max_tokens=10, stop_token_ids=(202,)))
    bench.run_until_idle()
    last = bench.last("a")
    assert last.finish_reason == "stop" and last.usage is not None
    assert last.usage.completion_tokens == 3


def test_stop_string_across_chunks_is_cut_and_held_back_prefixes_released() -> None:
    tokens = words(" the lighthouse keeper counts ships")
    text = text_model().decode(tokens)
    bench = scripted(tokens)
    bench.generate("a", request("a", max_tokens=30, stop=("keeper count",)))
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "stop"
    assert bench.text("a") == text[: text.index("keeper count")]


def test_held_prefix_of_a_stop_string_is_flushed_at_length() -> None:
    tokens = words(" a lighthouse")
    bench = scripted(tokens)
    bench.generate("a", request("a", max_tokens=len(tokens), stop=("lighthouses!",)))
    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"
    assert bench.text("a") == text_model().decode(tokens)


def test_multibyte_characters_split_over_tokens_join_to_the_decode() -> None:
    tokens = words(" café — 日本の夏 🌸")
    bench = scripted(tokens)
    bench.generate("a", request("a", max_tokens=len(tokens)))
    bench.run_until_idle()
    deltas = [c.text for c in bench.chunks["a"]]
    assert "".join(deltas) == text_model().decode(tokens)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token completed no character on its own


def test_context_full_ends_with_length() -> None:
    bench = Bench()
    bench.generate("a", request("a", prompt_ids=tuple(range(126))))  # max_tokens: the context
    bench.run_until_idle()
    last = bench.last("a")
    assert last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 2
