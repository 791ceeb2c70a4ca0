"""Incremental detokenizing: generated token ids in, text deltas out, one sequence at a time.

The prefix-offset method of vLLM and TGI. Two offsets into the generated ids: text up to
``read`` has been emitted; ``prefix`` is where the last emitted window began. Each push decodes
``ids[prefix:]`` and ``ids[prefix:read]`` and emits the difference, unless the window's text
ends in U+FFFD: then the last token(s) carry part of a character's UTF-8 bytes and the text is
held back until they complete. Decoding a window rather than one token keeps what a decoder does
at a token boundary (a leading space stripped by a Metaspace decoder) the same in both texts.

Windows only start where the text emitted so far ended with a whole character, so the deltas
join to exactly ``decode(all ids)`` once ``finish()`` has flushed the held tail (which may
really end in U+FFFD, e.g. when generation stops mid-character).

Usage::

    detokenizer = text_model.detokenizer()     # or IncrementalDetokenizer(decode)
    for token in generated:
        delta = detokenizer.push([token])      # "" while bytes are held back
    delta = detokenizer.finish()               # whatever is still held
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["REPLACEMENT_CHARACTER", "Decode", "IncrementalDetokenizer"]

REPLACEMENT_CHARACTER = "\ufffd"
Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated ids.

    Args:
        decode: ids -> text, special tokens skipped (``TextModel.decode``).
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._emitted: list[str] = []

    @property
    def ids(self) -> tuple[int, ...]:
        """Every id pushed so far."""
        return tuple(self._ids)

    @property
    def text(self) -> str:
        """The text emitted so far (the joined deltas)."""
        return "".join(self._emitted)

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; return the new text ("" while a character is incomplete)."""
        self._ids.extend(ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._emit(window_text[len(prefix_text) :], len(self._ids))

    def finish(self) -> str:
        """Return the text still held back (the sequence has ended)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        return self._emit(window_text[len(prefix_text) :], len(self._ids))

    def _emit(self, delta: str, end: int) -> str:
        self._prefix, self._read = self._read, end
        self._emitted.append(delta)
        return delta
