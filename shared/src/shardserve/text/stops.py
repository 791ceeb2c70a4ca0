"""Stop strings over a stream of text deltas, and the stop-token rule.

``StopStrings`` sits between the detokenizer and the client: each delta goes in, the text that
can safely be sent comes out. A tail that could be the start of a stop string is held back
until the next delta shows whether it is one. On a match the text before the match is
returned with ``stopped=True`` (the match and anything after it are dropped, as OpenAI does);
the sequence must then finish. At a finish for another reason, ``flush()`` returns the held
tail. With several stop strings, the one that starts first in the text wins.

Usage (scheduler, per sequence)::

    stops = StopStrings(params.stop)
    piece = stops.push(detokenizer.push(new_ids))
    send(piece.text)
    if piece.stopped: finish("stop")
    ...
    send(stops.push(detokenizer.finish()).text + stops.flush())   # at finish

``stop_token_ids(params, eos_ids)`` is the set of ids that end a sequence after the token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["StopPiece", "StopStrings", "stop_token_ids"]


@dataclass(frozen=True)
class StopPiece:
    """What a delta released: ``text`` to send, and whether a stop string matched."""

    text: str
    stopped: bool = False


class StopStrings:
    """Hold-back and matching of stop strings for one sequence.

    Args:
        stops: the stop strings (empty ones are ignored); none means text passes straight on.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._held

    def push(self, delta: str) -> StopPiece:
        """Add a delta; return the text that can be sent now. After a stop, always ""."""
        if self._stopped:
            return StopPiece("", stopped=True)
        text = self._held + delta
        match = _first_match(text, self._stops)
        keep = _partial_tail_start(text, self._stops)
        if match is not None and match <= keep:
            self._stopped, self._held = True, ""
            return StopPiece(text[:match], stopped=True)
        # No match yet, or one that a longer stop string starting earlier may still beat
        # ("aba" must win over "b" in "ab|a"): hold from where that one would start.
        self._held = text[keep:]
        return StopPiece(text[:keep])

    def flush(self) -> str:
        """Return the held tail: the sequence finished without completing another stop
        string (one that matched inside the tail still cuts it)."""
        held, self._held = self._held, ""
        if self._stopped:
            return ""
        match = _first_match(held, self._stops)
        if match is not None:
            self._stopped = True
            return held[:match]
        return held


def _first_match(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found, default=None)


def _partial_tail_start(text: str, stops: Sequence[str]) -> int:
    """Start of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = max((len(stop) for stop in stops), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(stop.startswith(tail) for stop in stops):
            return start
    return len(text)


def stop_token_ids(
    stop_ids: Iterable[int], eos_ids: Iterable[int], ignore_eos: bool = False
) -> frozenset[int]:
    """Ids that end a sequence (the token itself is not part of the text)."""
    return frozenset(stop_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))
