"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and
``/generate_stream``.

Body ``{"text_input": str, "parameters": {max_tokens, temperature, top_p, top_k, seed,
stop, stop_token_ids, ignore_eos, presence_penalty, frequency_penalty, repetition_penalty,
min_tokens}}`` -> ``{"model_name", "model_version", "text_output", "finish_reason"}``; the
parameters may also be given at the top level beside ``text_input``, as the TensorRT-LLM and
vLLM backends take them (the same one in both places is a 400). ``max_tokens`` left out
generates up to the context; other parameters left out take the model's defaults. The stream
is SSE, one ``data:`` per chunk with ``text_output`` the new text, the last one with
``finish_reason`` ("stop" or "length": the end marker); its status comes from the first
chunk, and a later error arrives as a last event ``{"error": ..., "code": ...}``. Errors
before the stream are the gateway's usual ``{"error", "code"}``. Unknown fields are refused
(a misspelt parameter would otherwise be silently ignored); ``parameters.stream`` is accepted
and ignored (the route decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from shardserve.errors import InferenceError
from shardserve.wire.protocol import GenerateChunk, SamplingParams, Usage
from shardserve_gateway.answer import Json, answer, json_body
from shardserve_gateway.codecs.openai_requests import ParamError, parse
from shardserve_gateway.generation.requests import Generated, generate_request, generation_servable
from shardserve_gateway.generation.requests import request_deadline as deadline_of
from shardserve_gateway.responses import error_body
from shardserve_gateway.routes.kserve import parse_version


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stream: bool | None = None  # accepted for Triton clients; the route decides

    def sampling(self) -> SamplingParams:
        values = self.model_dump(exclude={"stream"}, exclude_none=True)
        if isinstance(self.stop, str):
            values["stop"] = (self.stop,)
        return parse(SamplingParams, values)


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text_input: str
    parameters: GenerateParameters = GenerateParameters()


def generate_body(body: object) -> GenerateBody:
    """The body with top-level parameters moved into ``parameters``."""
    if not isinstance(body, dict):
        return parse(GenerateBody, body)
    top = {k: v for k, v in body.items() if k not in GenerateBody.model_fields}
    if not top:
        return parse(GenerateBody, body)
    nested = body.get("parameters")
    nested = nested if isinstance(nested, dict) else {}
    twice = sorted(set(top) & set(nested))
    if twice:
        raise ParamError(f"{twice[0]} is given both at the top level and in parameters", twice[0])
    merged = {**{k: v for k, v in body.items() if k not in top}, "parameters": {**nested, **top}}
    return parse(GenerateBody, merged)


def add_routes(app: web.Application) -> None:
    """Register the generate extension's routes."""
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(base + "/generate", generate)
        app.router.add_post(base + "/generate_stream", generate_stream)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=True)


async def _generate(request: web.Request, *, stream: bool) -> web.StreamResponse:
    model = request.match_info["model"]
    version = parse_version(request.match_info.get("version"))
    body = generate_body(await json_body(request, model))
    sampling = body.parameters.sampling()
    servable = generation_servable(request, model, version)
    generate = generate_request(servable, sampling, deadline_of(request), prompt=body.text_input)
    renderer = TritonRenderer(model, str(servable.version))
    return await answer(request, generate, renderer, stream=stream)


@dataclass
class TritonRenderer:
    model_name: str
    model_version: str

    def _output(self, text: str) -> Json:
        return {
            "model_name": self.model_name,
            "model_version": self.model_version,
            "text_output": text,
        }

    def whole(self, generated: Generated) -> Json:
        return {**self._output(generated.text), "finish_reason": generated.finish_reason}

    def events(self, chunk: GenerateChunk, first: bool) -> list[Json]:
        """The text of each chunk; the last event carries ``finish_reason`` (the end
        marker: a stream without it was cut)."""
        if chunk.finish_reason is not None:
            return [{**self._output(chunk.text), "finish_reason": chunk.finish_reason}]
        return [self._output(chunk.text)] if chunk.text else []

    def closing(self, usage: Usage | None) -> list[bytes]:
        return []

    def error(self, exc: InferenceError) -> Json:
        return dict(error_body(exc.message, code=exc.code))
