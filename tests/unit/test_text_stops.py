"""Stop strings over a stream of deltas (shardserve.text.stops): whatever the split, the text
sent is the text cut before the first stop string, and nothing after a stop is ever sent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.text.stops import StopStrings, stop_token_ids


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Feed every delta; return the text sent (flush included) and whether a stop matched."""
    matcher = StopStrings(stops)
    sent = []
    for delta in deltas:
        piece = matcher.push(delta)
        sent.append(piece.text)
    sent.append(matcher.flush())
    return "".join(sent), matcher.stopped


def expected(stops: list[str], text: str) -> tuple[str, bool]:
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return (text[: min(found)], True) if found else (text, False)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


SMALL = st.text(alphabet="ab\u00e9\n ", max_size=40)


@given(
    text=SMALL,
    stops=st.lists(st.text(alphabet="ab\u00e9\n ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
@settings(max_examples=500, deadline=None)
def test_any_split_sends_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    assert run(stops, split(text, cuts)) == expected(stops, text)


def test_a_possible_stop_prefix_is_held_until_resolved() -> None:
    matcher = StopStrings(["</end>"])
    assert matcher.push("Hello </").text == "Hello "
    assert matcher.held == "</"
    assert matcher.push("b>").text == "</b>"
    assert matcher.push(" x</en").text == " x"
    piece = matcher.push("d> ignored")
    assert piece.text == "" and piece.stopped
    assert matcher.push("more").text == "" and matcher.flush() == ""


def test_the_stop_that_starts_first_wins() -> None:
    matcher = StopStrings(["world", "lo w"])
    piece = matcher.push("hello world")
    assert (piece.text, piece.stopped) == ("hel", True)


def test_a_stop_inside_one_delta_cuts_it() -> None:
    piece = StopStrings(["\n\n"]).push("line one\n\nline two")
    assert (piece.text, piece.stopped) == ("line one", True)


def test_flush_sends_a_held_tail_when_the_sequence_ends_otherwise() -> None:
    matcher = StopStrings(["STOP"])
    assert matcher.push("almost ST").text == "almost "
    assert matcher.flush() == "ST"
    assert not matcher.stopped


def test_no_stops_passes_text_straight_on() -> None:
    matcher = StopStrings([])
    assert matcher.push("anything <").text == "anything <"
    assert matcher.flush() == ""


def test_stop_token_ids_join_eos_unless_ignored() -> None:
    assert stop_token_ids([7], [1, 4]) == {1, 4, 7}
    assert stop_token_ids([7], [1, 4], ignore_eos=True) == {7}


def test_a_longer_stop_that_starts_earlier_beats_a_shorter_one_already_matched() -> None:
    # "b" matches in "ab", but "aba" may still complete from index 0: hold until it does.
    assert run(["b", "aba"], ["ab", "a"]) == ("", True)
    assert run(["b", "aba"], ["ab", "c"]) == ("a", True)
    assert run(["b", "aba"], ["ab"]) == ("a", True)  # finished while undecided: "b" cuts
