"""Generation messages: requests, cancels and numbered chunks; the steps that advance
sequences over the mesh, their results, and freeing sequences' KV."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from shardserve.wire.bounds import (
    MAX_ARRAY_ITEMS,
    MAX_PROMPT_BYTES,
    Count,
    Deadline,
    Text,
    TokenId,
    greedy_below_minimum,
    utf8_size,
)
from shardserve.wire.message import ErrorInfo, TensorMap, _Message

# ---------------------------------------------------------------- generation (public)


MAX_LOGIT_BIAS = 300  # entries of a logit_bias map


class LogitBias(BaseModel):
    """One entry of a ``logit_bias`` map: added to the token's logit before sampling
    (OpenAI's range: -100 bans a token, 100 all but forces it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: TokenId
    bias: float = Field(ge=-100.0, le=100.0, allow_inf_nan=False)


class SamplingParams(BaseModel):
    """How one sequence chooses its tokens and when it stops.

    ``temperature`` 0 is greedy (the lowest token id wins a tie). With a ``seed`` the
    choice of token ``i`` of the sequence depends only on (seed, i) and the logits, so a
    sequence samples the same tokens alone or in any batch. ``stop`` strings end the text
    before the match (the match is not returned); ``stop_token_ids`` and the model's EOS ids
    (unless ``ignore_eos``) end it after the token, which is not part of the text either.
    ``logprobs`` N > 0 returns the chosen token's log-probability and the N most likely.

    A field left None takes the model's default: generation_config.json's ``temperature``,
    ``top_p``, ``top_k`` and ``repetition_penalty`` (``do_sample: false`` means greedy), else
    temperature 1, no cut and no penalty; ``max_tokens`` None generates up to the context.
    Penalties follow vLLM: ``repetition_penalty`` divides the positive logits (multiplies the
    negative) of every token of the prompt and the output; ``presence_penalty`` and
    ``frequency_penalty`` subtract from the logits of tokens in the output (once, and once per
    occurrence). ``logit_bias`` adds to the named ids' logits; ``min_tokens`` masks the EOS
    and ``stop_token_ids`` until that many tokens are generated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    # (below bounds.MIN_TEMPERATURE: greedy)
    temperature: Annotated[float, AfterValidator(greedy_below_minimum)] | None = Field(
        default=None, ge=0.0, le=100.0, allow_inf_nan=False
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Count | None = None  # 0: no top-k cut
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: tuple[LogitBias, ...] = Field(default=(), max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: tuple[Annotated[Text, Field(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=16
    )
    stop_token_ids: tuple[TokenId, ...] = Field(default=(), max_length=64)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatMessage(BaseModel):
    """One message of a chat, rendered with the checkpoint's chat template."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Text = Field(min_length=1, max_length=64)
    content: Text


class GenerateRequest(_Message):
    """Generate text from a prompt (text, token ids, or chat messages: exactly one).

    The answer is a stream of GenerateChunk messages to ``reply_to`` with the request's
    ``correlation_id``, numbered from 0; the last has a ``finish_reason`` or an ``error``.
    A GenerateCancel with the same ``reply_to`` and ``correlation_id`` stops it.
    """

    kind: Literal["generate.request"] = "generate.request"
    id: Text = Field(min_length=1, max_length=128)
    servable: Text = Field(min_length=1, max_length=128)
    version: Count = 0
    prompt: Text | None = None
    prompt_ids: tuple[TokenId, ...] | None = Field(default=None, max_length=MAX_ARRAY_ITEMS - 1)
    messages: tuple[ChatMessage, ...] | None = Field(default=None, max_length=4096)
    sampling: SamplingParams = SamplingParams()
    deadline: Deadline

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, prompt_ids and messages must be given "
                f"(given: {', '.join(given) or 'none'})"
            )
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        texts = (
            [self.prompt] if self.prompt is not None else [m.content for m in self.messages or ()]
        )
        size = sum(utf8_size(text) for text in texts)
        if size > MAX_PROMPT_BYTES:
            raise ValueError(
                f"prompt text of {size} UTF-8 bytes exceeds the limit of {MAX_PROMPT_BYTES}"
            )
        return self


class GenerateCancel(_Message):
    """Stop a generation (the caller left): its sequence leaves the mesh within one step,
    its KV cache is freed on every rank, and its stream ends with a ``cancelled`` error.
    Published like the request (same exchange and key), so it never overtakes it."""

    kind: Literal["generate.cancel"] = "generate.cancel"
    reply_to: Text = Field(min_length=1, max_length=255)
    correlation_id: Text = Field(min_length=1, max_length=128)


class TopLogprob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: int
    text: str
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token, its log-probability, and the most likely alternatives."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class GenerateChunk(_Message):
    """One message of a generation's stream: new tokens and their text.

    ``seq`` numbers a stream's messages from 0 (a receiver detects a gap or a duplicate).
    ``text`` is the text the new tokens complete; bytes of a character not yet complete
    are held back until a later token completes it, so the texts joined are the text.
    The last message of a stream, and only it, has ``finish_reason`` ("stop": an EOS or
    stop token or string; "length": ``max_tokens`` or the model's context) with ``usage``,
    or ``error``.
    """

    kind: Literal["generate.chunk"] = "generate.chunk"
    id: str
    seq: int = Field(ge=0)
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: Literal["stop", "length"] | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


# ---------------------------------------------------------------- steps (internal)


class SequenceSpan(BaseModel):
    """Rows ``[offset, offset + count)`` of a step's packed tensors are tokens
    ``[start, start + count)`` of sequence ``seq``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    start: int = Field(ge=0)
    count: int = Field(ge=1)


class SequenceReservation(BaseModel):
    """Room for ``capacity`` tokens of a new sequence in every rank's KV cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    capacity: int = Field(ge=1)


class RowSampling(BaseModel):
    """How the last stage's leader picks the next token of one logit row: ``index`` is
    the position of that token among the sequence's generated tokens (for the seeded RNG)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(ge=0)
    index: int = Field(ge=0)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[LogitBias, ...] = ()
    # Ids masked (EOS and stop ids) while ``index`` < ``min_tokens``.
    min_tokens: int = 0
    masked_until_min: tuple[int, ...] = ()
    # The history the penalties read, sent only when a penalty is set: the prompt's distinct
    # ids (repetition_penalty) and the generated ids so far.
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether the penalties read the history (prompt and output ids)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (penalties, bias, min_tokens mask)."""
        return self.penalized or bool(self.logit_bias) or self.index < self.min_tokens

    def after(self, token: int) -> RowSampling:
        """This row one token further on (a decode run's next iteration)."""
        update: dict[str, object] = {"index": self.index + 1}
        if self.penalized:
            update["output_ids"] = (*self.output_ids, token)
        return self.model_copy(update=update)


class StepWork(_Message):
    """One generation step for one pipeline stage: the packed tokens of several sequences
    (prefill chunks and single decode tokens mixed), in one publish to every rank of it.

    Before running, each rank frees ``free`` and reserves ``reserve`` in its KV cache; the
    ``attention`` ops then read and extend the caches of the ``layout``'s sequences. The
    inputs are ``input_ids`` (stage 0) or the previous stage's hidden state, with
    ``positions`` and ``logit_rows``. The last stage's leader samples one token per logit
    row with ``sampling`` (same order) and returns them in its StepResult.

    ``decode_steps`` K > 1 (a *decode run*, only for a group of one stage): every row is a
    one-token decode row with a logit row, and every rank runs K iterations of the stage;
    iteration i + 1's ``input_ids`` are the tokens sampled at iteration i, its positions,
    span starts and sampling indexes are i + 1 further on, its logit rows the same. Every
    rank holds the logits and samples itself (the choice is deterministic). The leader
    reports each iteration i < K - 1 in a StepResult with ``iteration`` i; every rank then
    reports the last (see StepResult).
    """

    kind: Literal["step.work"] = "step.work"
    step: str
    servable: str
    version: int
    stage: int = Field(ge=0)
    inputs: TensorMap
    digest: str
    deadline: float
    result_to: str
    layout: tuple[SequenceSpan, ...] = ()
    reserve: tuple[SequenceReservation, ...] = ()
    free: tuple[int, ...] = ()
    sampling: tuple[RowSampling, ...] = ()
    decode_steps: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _decode_run(self) -> StepWork:
        if self.decode_steps == 1:
            return self
        if any(span.count != 1 for span in self.layout) or len(self.sampling) != len(self.layout):
            raise ValueError(
                f"a step of {self.decode_steps} decode steps must have one token and one "
                "sampled row per sequence"
            )
        return self


class StepResult(_Message):
    """One rank's outcome of a generation step's stage (as StageResult for a job), and from
    the last stage's leader the sampled ``tokens`` (one per logit row) with their logprobs.

    In a decode run of K steps (``StepWork.decode_steps``) the leader sends one result per
    iteration i < K - 1 (``iteration`` i, its tokens, no digest), then every rank sends
    its final result (``iteration`` K - 1, the tokens at the leader) whose ``digest`` is
    that of all K iterations' sampled tokens: the scheduler checks that the ranks agreed.
    An error ends the run at any iteration.

    ``broken_rows``: the logit rows (indexes into ``tokens``) that were not finite, whose
    tokens mean nothing: those sequences end with an error, the others take their tokens.
    """

    kind: Literal["step.result"] = "step.result"
    step: str
    servable: str
    version: int
    stage: int
    rank: int
    digest: str = ""
    outputs: TensorMap | None = None
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    broken_rows: tuple[int, ...] = ()
    error: ErrorInfo | None = None
    compute_ms: float = 0.0
    collective_ms: float = 0.0
    kv_used_bytes: int = 0
    iteration: int = Field(default=0, ge=0)


class SequencesFree(_Message):
    """Ranks free these sequences' KV caches (finished, cancelled or failed between steps).
    Sent on the stage exchange like StepWork, so it keeps its place among the steps."""

    kind: Literal["step.free"] = "step.free"
    servable: str
    version: int
    stage: int = Field(ge=0)
    seqs: tuple[int, ...] = Field(min_length=1)
