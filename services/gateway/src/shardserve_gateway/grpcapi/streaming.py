"""``ModelStreamInfer``: Triton's streaming (decoupled) convention over one bidirectional
call.

Each ModelInferRequest on the stream is served on its own, concurrently, and answered
with ModelStreamInferResponses carrying the request's ``id``:

- a **text-generation** servable takes ``text_input`` (BYTES, one element) and its
  sampling parameters as scalar inputs, as request parameters, or as vLLM's
  ``sampling_parameters`` JSON input (the same names as Triton's generate extension:
  max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos). Every
  text delta is one response with output ``text_output``; the last one carries parameter
  ``triton_final_response: true`` and ``finish_reason``. With request parameter
  ``triton_enable_empty_final_response`` the deltas all say ``false`` and an empty
  response marks the end, as Triton does.
- any other servable answers once, as ModelInfer does (marked final).

A request that fails gets one response with ``error_message`` (the stream goes on). A
client that cancels the call (or its deadline) cancels every generation still running
on it: leaving ``dispatcher.generate`` publishes the GenerateCancel, which frees the
sequence's KV cache on every rank, as an HTTP disconnect does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import numpy as np
from aiohttp import web

from shardserve.errors import BadInputError, InferenceError
from shardserve.wire.protocol import GenerateChunk, ServableStatus
from shardserve.wire.tensors import BYTES_DTYPE, Tensor, pack_bytes_elements
from shardserve_gateway.codecs.kserve import parse_json_object
from shardserve_gateway.codecs.openai_requests import parse
from shardserve_gateway.errors import INTERNAL_MESSAGE
from shardserve_gateway.generation.metrics import StreamTiming
from shardserve_gateway.generation.requests import (
    deadline_after,
    generate_request,
    raise_chunk_error,
    ready_generation_servable,
)
from shardserve_gateway.grpcapi.calls import Call, CallGuard
from shardserve_gateway.grpcapi.infer import deadline_timeout, infer
from shardserve_gateway.grpcapi.infer_codec import decode_infer, parameter_values
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.transport.context import CallContext
from shardserve_gateway.grpcapi.transport.wire import CallError
from shardserve_gateway.mesh_view import split_model_name
from shardserve_gateway.routes import kserve
from shardserve_gateway.routes.generate import GenerateParameters
from shardserve_gateway.state import DISPATCHER_KEY, MESH_VIEW_KEY, METRICS_KEY

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
SAMPLING_JSON = "sampling_parameters"
# Inputs and parameters Triton clients send that change nothing here: we always stream,
# never echo the prompt, and the KServe codec reads its own parameters.
# Triton's ``timeout`` and ``priority`` request parameters are not honoured (the gRPC
# deadline is the timeout).
IGNORED = frozenset(
    {"stream", "exclude_input_in_output", "timeout_ms", "timeout", "priority", "binary_data_output"}
)

_logger = logging.getLogger(__name__)

Context: TypeAlias = CallContext
Send: TypeAlias = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


class StreamInfer:
    """Serves the requests of ModelStreamInfer calls."""

    def __init__(self, app: web.Application, guard: CallGuard) -> None:
        self._app = app
        self._guard = guard

    async def run(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context, call: Call
    ) -> None:
        """Serve every request of the stream until the client closes its side and all
        are answered (a cancelled call cancels them all; a malformed message ends the
        call with INVALID_ARGUMENT once the requests before it are answered)."""
        lock = asyncio.Lock()

        async def send(response: pb.ModelStreamInferResponse) -> None:
            async with lock:  # one write at a time on the call
                if context.done():  # ended (deadline, cancel): a write would fail, unread
                    return
                await context.write(response)

        refused: InferenceError | CallError | None = None
        async with asyncio.TaskGroup() as group:
            try:
                async for request in requests:
                    group.create_task(self._answer(request, context, call, send))
            except (InferenceError, CallError) as exc:
                # A malformed (or oversized) message ends the stream, but only once the
                # requests before it are answered (each gets its own response first).
                refused = exc
        if refused is not None:
            raise refused

    async def _answer(
        self, request: pb.ModelInferRequest, context: Context, call: Call, send: Send
    ) -> None:
        try:
            servable = self._generation_servable(request)
            if servable is None:
                response = await self._infer(request, context, call)
                await send(pb.ModelStreamInferResponse(infer_response=response))
            else:
                await self._generate(request, servable, context, call, send)
        except InferenceError as exc:
            await send(_error(request, exc.message))
        except Exception:
            _logger.exception("internal error in a ModelStreamInfer request")
            await send(_error(request, INTERNAL_MESSAGE))

    def _generation_servable(self, request: pb.ModelInferRequest) -> ServableStatus | None:
        """The generation servable the request names, or None for an ordinary model."""
        name, method = split_model_name(request.model_name)
        if method is not None:
            return None
        version = kserve.parse_version(request.model_version or None)
        found = self._app[MESH_VIEW_KEY].find_servable(name, version)
        return found if found.generation else None

    async def _infer(
        self, request: pb.ModelInferRequest, context: Context, call: Call
    ) -> pb.ModelInferResponse:
        response = await infer(self._app, request, context, call)
        response.parameters[FINAL].bool_param = True
        return response

    async def _generate(
        self,
        request: pb.ModelInferRequest,
        servable: ServableStatus,
        context: Context,
        call: Call,
        send: Send,
    ) -> None:
        prompt, values, empty_final = generation_inputs(request)
        version = kserve.parse_version(request.model_version or None)
        found = ready_generation_servable(self._app, servable.name, version, _label(call))
        sampling = parse(GenerateParameters, values).sampling()
        deadline = deadline_after(self._app, deadline_timeout(context))
        wire = generate_request(found, sampling, deadline, prompt=prompt)
        reply = _Replies(request, str(found.version), empty_final)
        timing = StreamTiming(self._app[METRICS_KEY].generation, found.name)
        async with self._app[DISPATCHER_KEY].generate(wire) as chunks:
            async for chunk in chunks:
                timing.chunk(chunk)
                raise_chunk_error(chunk)
                for response in reply.responses(chunk):
                    await send(response)


def _label(call: Call) -> Callable[[tuple[str, str]], None]:
    def labelled(labels: tuple[str, str]) -> None:
        call.labels = call.labels or labels

    return labelled


def generation_inputs(request: pb.ModelInferRequest) -> tuple[str, dict[str, Any], bool]:
    """The prompt, the sampling values and whether an empty final response is wanted."""
    parameters = parameter_values(request.parameters)
    empty_final = bool(parameters.pop(EMPTY_FINAL, False))
    values = {
        k: v for k, v in parameters.items() if k not in IGNORED and not k.startswith("triton_")
    }
    inputs = decode_infer(_without_parameters(request)).inputs
    if TEXT_INPUT not in inputs:
        raise BadInputError(f"a generation request needs input {TEXT_INPUT!r} (BYTES, one element)")
    prompt = _text(TEXT_INPUT, inputs.pop(TEXT_INPUT))
    if SAMPLING_JSON in inputs:
        values.update(_sampling_json(inputs.pop(SAMPLING_JSON)))
    for name, tensor in inputs.items():
        if name not in IGNORED:
            values[name] = _scalar(name, tensor)
    return prompt, values, empty_final


def _without_parameters(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """The request with its parameters dropped (sampling values are not KServe ones)."""
    copy = pb.ModelInferRequest()
    copy.CopyFrom(request)
    copy.ClearField("parameters")
    return copy


def _elements(name: str, tensor: Tensor) -> list[Any]:
    array = tensor.to_numpy().reshape(-1)
    return [v.item() if hasattr(v, "item") else v for v in array]


def _text(name: str, tensor: Tensor) -> str:
    if tensor.dtype != BYTES_DTYPE:
        raise BadInputError(f"input {name!r} must be BYTES")
    elements = _elements(name, tensor)
    if len(elements) != 1:
        raise BadInputError(f"input {name!r} must hold one element, got {len(elements)}")
    try:
        return bytes(elements[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"input {name!r} is not UTF-8") from None


def _sampling_json(tensor: Tensor) -> dict[str, Any]:
    what = f"input {SAMPLING_JSON!r}"
    return parse_json_object(_text(SAMPLING_JSON, tensor).encode(), what, exact=True)


def _scalar(name: str, tensor: Tensor) -> Any:
    """A one-element input as a Python value (BYTES: its text)."""
    if tensor.dtype == BYTES_DTYPE:
        return _text(name, tensor)
    elements = _elements(name, tensor)
    if len(elements) != 1:
        raise BadInputError(f"input {name!r} must hold one element, got {len(elements)}")
    return elements[0]


class _Replies:
    """Turns a generation's chunks into stream responses."""

    def __init__(self, request: pb.ModelInferRequest, version: str, empty_final: bool) -> None:
        self._request = request
        self._version = version
        self._empty_final = empty_final

    def responses(self, chunk: GenerateChunk) -> list[pb.ModelStreamInferResponse]:
        out: list[pb.ModelStreamInferResponse] = []
        final = chunk.last and not self._empty_final
        if chunk.text or final:
            out.append(self._response(chunk.text, final, chunk.finish_reason))
        if chunk.last and self._empty_final:
            out.append(self._response(None, True, chunk.finish_reason))
        return out

    def _response(
        self, text: str | None, final: bool, finish_reason: str | None
    ) -> pb.ModelStreamInferResponse:
        response = pb.ModelInferResponse(
            model_name=self._request.model_name, model_version=self._version, id=self._request.id
        )
        if text is not None:
            response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
            response.raw_output_contents.append(pack_bytes_elements(_one(text)))
        response.parameters[FINAL].bool_param = final
        if final and finish_reason is not None:
            response.parameters["finish_reason"].string_param = finish_reason
        return pb.ModelStreamInferResponse(infer_response=response)


def _one(text: str) -> np.ndarray:
    return np.array([text], dtype=object)


def _error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)
