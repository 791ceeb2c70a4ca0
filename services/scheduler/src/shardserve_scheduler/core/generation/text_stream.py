"""One sequence's text as its tokens arrive: detokenized incrementally, cut at stop strings.

Stop token ids (the request's and, unless ``ignore_eos``, the model's EOS ids) end the
sequence after the token, which adds no text; a stop string ends it before the match.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardserve.text.detokenize import IncrementalDetokenizer
from shardserve.text.stops import StopStrings


@dataclass(frozen=True)
class TokenText:
    """What one new token released: text to send now, and whether the sequence stops."""

    text: str
    stopped: bool


class TextStream:
    """Detokenizer + stop strings + stop ids of one sequence."""

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop_strings: Iterable[str],
        stop_ids: frozenset[int],
    ) -> None:
        self._detokenizer = detokenizer
        self._stops = StopStrings(tuple(stop_strings))
        self._stop_ids = stop_ids

    def push(self, token: int) -> TokenText:
        if token in self._stop_ids:
            return TokenText("", stopped=True)
        piece = self._stops.push(self._detokenizer.push([token]))
        return TokenText(piece.text, piece.stopped)

    def finish(self) -> str:
        """The text still held back (bytes of a character, a stop-string prefix) at the end
        of a sequence that did not stop on a stop string."""
        piece = self._stops.push(self._detokenizer.finish())
        return piece.text + self._stops.flush()
