"""The bounds of what enters: every number and string a public message carries.

Public wire messages (GenerateRequest, SamplingParams, ChatMessage, InferRequest...) type
their fields with these, so a value the mesh cannot carry or compute with is refused where
it enters (the gateway answers 400 naming the field and the limit; a queue-level message
is dead-lettered by the decoder with the same words), never deeper in:

* integers fit a signed 32- or 64-bit slot (msgpack cannot pack >= 2**64; a token id is
  an int32 tensor element on the ranks);
* floats are finite (a NaN deadline never expires; a NaN temperature samples nothing);
* text is valid Unicode that encodes to UTF-8 (an unpaired surrogate such as ``"\\ud800"``
  cannot be packed) and, with arrays, stays within the decoder's own limits below, so
  nothing the gateway lets through is dead-lettered by the scheduler's decoder.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

# The msgpack decoder's limits (shardserve.wire.codec): one string, one array.
MAX_STR_BYTES = 1024 * 1024
MAX_ARRAY_ITEMS = 1_000_000
# A prompt (its text, or its chat messages' contents together) in UTF-8 bytes.
MAX_PROMPT_BYTES = MAX_STR_BYTES
# Token ids travel as int32 tensor elements.
MAX_TOKEN_ID = 2**31 - 1
# Temperatures below this sample greedily: dividing logits by a subnormal number
# overflows, and no float64 draw tells such a distribution from the argmax anyway.
MIN_TEMPERATURE = 1e-5


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8; ValueError naming the position of an unpaired surrogate."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text is not valid Unicode: unpaired surrogate {text[exc.start]!r} "
            f"at character {exc.start}"
        ) from None


def _text_within(limit: int) -> AfterValidator:
    def check(text: str) -> str:
        size = utf8_size(text)
        if size > limit:
            raise ValueError(f"text of {size} UTF-8 bytes exceeds the limit of {limit}")
        return text

    return AfterValidator(check)


# Any string of a public message.
Text = Annotated[str, _text_within(MAX_STR_BYTES)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# A count or size (top_k, max_tokens...): fits a signed 32-bit slot.
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Absolute unix seconds: finite.
Deadline = Annotated[float, Field(allow_inf_nan=False)]


def greedy_below_minimum(temperature: float) -> float:
    """``temperature``, or 0.0 (greedy) below MIN_TEMPERATURE."""
    return 0.0 if temperature < MIN_TEMPERATURE else temperature
