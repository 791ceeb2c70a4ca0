"""A request's sampling with the model's defaults filled in: what the sequence runs with.

``decoding(params, text, prompt_len, max_positions)`` takes the request's SamplingParams
(fields left None take generation_config.json's defaults, see
``shardserve.text.generation_defaults``) and gives the token budget and the RowSampling every
step of the sequence starts from. Refusals (BadInputError, a 400 naming the field):
``max_tokens`` beyond what the context leaves after the prompt (as OpenAI and vLLM answer),
``logit_bias`` ids outside the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from shardserve.errors import BadInputError
from shardserve.text.tokenizer import TextModel
from shardserve.wire.protocol import RowSampling, SamplingParams

__all__ = ["Decoding", "decoding"]

T = TypeVar("T")


@dataclass(frozen=True)
class Decoding:
    max_tokens: int
    row: RowSampling  # of the sequence's first generated token (index 0, no output yet)


def decoding(
    params: SamplingParams, text: TextModel, prompt: tuple[int, ...], max_positions: int
) -> Decoding:
    """The sequence's budget and first row; BadInputError when the request cannot run."""
    room = max_positions - len(prompt)
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if params.max_tokens is not None and 0 < room < max_tokens:  # room 0: never_fits says
        raise BadInputError(
            f"max_tokens is {max_tokens}, but the model's context is {max_positions} tokens "
            f"and the prompt has {len(prompt)}: at most {max(room, 0)} tokens can be generated"
        )
    _check_bias(params, text)
    defaults = text.sampling_defaults
    row = RowSampling(
        seq=0,
        index=0,
        temperature=_pick(params.temperature, defaults.temperature, 1.0),
        top_p=_pick(params.top_p, defaults.top_p, 1.0),
        top_k=_pick(params.top_k, defaults.top_k, 0),
        seed=params.seed or 0,
        logprobs=params.logprobs,
        repetition_penalty=_pick(params.repetition_penalty, defaults.repetition_penalty, 1.0),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        masked_until_min=_masked_until_min(params, text),
    )
    if row.repetition_penalty != 1.0:
        row = row.model_copy(update={"prompt_ids": tuple(sorted(set(prompt)))})
    return Decoding(max(max_tokens, 1), row)


def _pick(given: T | None, default: T | None, fallback: T) -> T:
    if given is not None:
        return given
    return fallback if default is None else default


def _check_bias(params: SamplingParams, text: TextModel) -> None:
    for entry in params.logit_bias:
        if entry.token_id >= text.vocab_size:
            raise BadInputError(
                f"logit_bias names token {entry.token_id}, outside the vocabulary "
                f"[0, {text.vocab_size}) of servable {text.servable}"
            )


def _masked_until_min(params: SamplingParams, text: TextModel) -> tuple[int, ...]:
    """The ids min_tokens holds back: the stop ids and (unless ignore_eos) EOS, in the vocab."""
    if params.min_tokens == 0:
        return ()
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(text.eos_token_ids)
    return tuple(sorted(i for i in ids if i < text.vocab_size))
