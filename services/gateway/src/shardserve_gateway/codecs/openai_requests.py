"""OpenAI request bodies (/v1/completions, /v1/chat/completions) -> SamplingParams and a
prompt, validated with pydantic.

Unknown fields are ignored, as OpenAI and vLLM do (clients send ``user``... by default);
the fields we cannot honour are refused with a 400 naming them: ``n`` other than 1, ``echo``
true, more than one prompt, ``best_of`` > 1, a ``suffix``, ``tools``, a ``response_format``
other than text. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (OpenAI's)
and vLLM's extensions ``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``
and ``ignore_eos`` are honoured. A field left out takes the model's default (its
generation_config.json); ``max_tokens`` left out is 16 on /v1/completions (OpenAI's and
vLLM's default) and up to the context on /v1/chat/completions. A validation error names the
field (``param`` in OpenAI's error shape).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardserve.errors import BadInputError
from shardserve.wire.protocol import MAX_LOGIT_BIAS, ChatMessage, LogitBias, SamplingParams

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_LOGPROBS = 5


class ParamError(BadInputError):
    """A 400 naming the request field at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 = no cut
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # vLLM
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM
    tools: Any = None
    response_format: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: Any) -> Any:
        if tools:
            raise ValueError("tools are not supported (no tool calls are generated)")
        return tools

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else value
        if value is not None and kind != "text":
            raise ValueError(
                f"response_format {kind!r} is not supported (no schema-guided decoding); "
                "only {'type': 'text'}"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0) if self.top_k is not None else None,
            "seed": self.seed,
            "stop": (self.stop,) if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": _logit_bias(self.logit_bias),
            "min_tokens": self.min_tokens,
        }
        return parse(SamplingParams, {k: v for k, v in values.items() if v is not None})


def _logit_bias(bias: dict[str, float] | None) -> tuple[LogitBias, ...] | None:
    """OpenAI's map of token id (a JSON key: a string) to bias, each entry checked by the
    wire's LogitBias (its bounds: a 400 naming the token)."""
    if bias is None:
        return None
    entries = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):  # (int() refuses "²", a digit)
            raise ParamError(f"logit_bias: {key!r} is not a token id", "logit_bias")
        try:
            entries.append(LogitBias(token_id=int(key), bias=value))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ParamError(
                f"logit_bias: token {key}: {field} {first['msg']}", "logit_bias"
            ) from None
    return tuple(sorted(entries, key=lambda entry: entry.token_id))


class CompletionBody(_Common):
    """POST /v1/completions."""

    # Checked by prompt_kind: a pydantic union would name its members in the error.
    prompt: Any
    max_tokens: int | None = Field(default=COMPLETIONS_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported (the prompt is not returned)")
        return echo

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of != 1:
            raise ValueError("best_of > 1 is not supported (one candidate per request)")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported (no insertion: text is only appended)")
        return suffix

    def prompt_kind(self) -> tuple[str | None, tuple[int, ...] | None]:
        """(prompt text, None) or (None, prompt token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt, None
        if not isinstance(prompt, list) or not prompt:
            raise ParamError(
                PROMPT_SHAPES if prompt != [] else "prompt must not be empty", "prompt"
            )
        if all(_is_int(p) for p in prompt):
            return None, _token_ids(prompt)
        if len(prompt) > 1:
            raise ParamError(
                "one prompt per request (a batch of prompts is not supported)", "prompt"
            )
        only = prompt[0]
        if isinstance(only, str):
            return only, None
        if isinstance(only, list) and only and all(_is_int(p) for p in only):
            return None, _token_ids(only)
        raise ParamError(PROMPT_SHAPES if only != [] else "prompt must not be empty", "prompt")


PROMPT_SHAPES = "prompt must be a string or a list of token ids (or a list of one of those)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[int]) -> tuple[int, ...]:
    if any(v < 0 for v in values):
        raise ParamError("prompt token ids must be >= 0", "prompt")
    return tuple(values)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart]

    def message(self) -> ChatMessage:
        """The wire message (its bounds checked: a 400 naming the field)."""
        content = self.content
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return parse(ChatMessage, {"role": self.role, "content": text})


class ChatBody(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def chat_sampling(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs set to true", "top_logprobs")
        count = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else None
        return self.sampling(limit if limit is not None else self.max_tokens, count)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: object) -> M:
    """Validate ``body``; a 400 naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ParamError(f"{param}: {message}" if param else message, param) from None
