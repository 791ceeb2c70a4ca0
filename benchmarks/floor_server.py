"""The floor: one process, aiohttp + onnxruntime, KServe v2 infer (JSON and binary).

What a minimal single-process server costs for the same request body the mesh gets: HTTP,
JSON (or binary-extension) decode, one ``session.run`` on the unsliced model, encode.
No broker, no validation beyond what decoding needs. The mesh is compared against it.
JSON is read with orjson (``--json fast``, the default: the fastest common JSON library,
what a well-made plain server uses) and ``np.asarray``, and written from numpy by orjson.
Two other readings serve as references: ``--json numeric`` reads the body the way the
gateway does (``shardserve_gateway.codecs.numeric_json``: numeric ``data`` straight into numpy),
so the ``floor-numeric`` ratios measure the mesh's overhead with no difference of JSON
parsers at all; ``--json stdlib`` uses Python's ``json`` module (``tolist()`` out), what a
plain single-process server does: the ``floor-stdlib`` scenario, the least demanding one.

    python -m benchmarks.floor_server --model MODEL.onnx --port 8500 [--threads 1]
        [--json fast|numeric|stdlib]

Routes: ``GET /v2/health/ready``, ``POST /v2/models/{model}/infer``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from aiohttp import web

from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.heap import keep_freed_memory
from shardserve.wire.tensors import DATATYPE_TO_DTYPE, DTYPE_TO_DATATYPE
from shardserve_gateway.codecs import fast_json, numeric_json

HEADER_LENGTH = "Inference-Header-Content-Length"
SESSION_KEY = web.AppKey("session", ort.InferenceSession)
JSON_KEY = web.AppKey("json_reading", str)  # fast | numeric | stdlib


def load_session(model: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])


def read_json(raw: bytes, reading: str) -> Any:
    if reading == "stdlib":
        return json.loads(raw)
    if reading == "numeric":
        doc = numeric_json.loads_request(raw)
        if doc is not None:
            return doc
    return fast_json.loads(raw)


def decode_inputs(
    body: bytes, header_length: str | None, reading: str = "fast"
) -> tuple[dict[str, np.ndarray], bool]:
    """(inputs, binary_output) from a KServe v2 JSON or binary-extension body."""
    json_end = len(body) if header_length is None else int(header_length)
    doc = read_json(body[:json_end], reading)
    offset = json_end
    inputs: dict[str, np.ndarray] = {}
    for spec in doc["inputs"]:
        dtype = np.dtype(DATATYPE_TO_DTYPE[spec["datatype"]])
        size = spec.get("parameters", {}).get("binary_data_size")
        if size is None:
            array = np.asarray(spec["data"], dtype=dtype)
        else:
            array = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            offset += size
        inputs[spec["name"]] = array.reshape(spec["shape"])
    binary = bool(doc.get("parameters", {}).get("binary_data_output", False))
    return inputs, binary


def encode_outputs(
    model: str, outputs: dict[str, np.ndarray], binary: bool, stdlib: bool = False
) -> tuple[bytes, dict[str, str]]:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    finite = True
    for name, array in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": DTYPE_TO_DATATYPE[array.dtype.str],
            "shape": list(array.shape),
        }
        if binary:
            blob = np.ascontiguousarray(array).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif stdlib:
            entry["data"] = array.reshape(-1).tolist()
        else:
            entry["data"] = fast_json.json_values(array.reshape(-1))
            finite = finite and fast_json.all_finite(array)
        entries.append(entry)
    doc = {"model_name": model, "outputs": entries}
    header = json.dumps(doc).encode() if stdlib else fast_json.dumps(doc, finite=finite)
    if not blobs:
        return header, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return b"".join([header, *blobs]), headers


async def infer(request: web.Request) -> web.Response:
    session, reading = request.app[SESSION_KEY], request.app[JSON_KEY]
    stdlib = reading == "stdlib"
    body = await request.read()
    inputs, binary = decode_inputs(body, request.headers.get(HEADER_LENGTH), reading)
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, inputs)
    outputs = dict(zip(names, values, strict=True))
    data, headers = encode_outputs(request.match_info["model"], outputs, binary, stdlib)
    return web.Response(body=data, headers=headers)


async def ready(request: web.Request) -> web.Response:
    return web.Response(body=b'{"ready":true}', content_type="application/json")


def create_app(
    model: Path, threads: int = 1, max_body_mb: int = 256, json_reading: str = "fast"
) -> web.Application:
    app = web.Application(client_max_size=max_body_mb * 1024 * 1024)
    app[SESSION_KEY] = load_session(model, threads)
    app[JSON_KEY] = json_reading
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_post("/v2/models/{model}/infer", infer)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.floor_server")
    parser.add_argument("--model", type=Path, required=True, help="the unsliced ONNX model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument(
        "--json",
        choices=("fast", "numeric", "stdlib"),
        default="fast",
        help="JSON reading: orjson, the gateway's numeric_json, or Python's json module",
    )
    args = parser.parse_args(argv)
    app = create_app(args.model, args.threads, json_reading=args.json)
    # The same event loop as the mesh's services (uvloop unless SHARDSERVE_EVENT_LOOP says)
    # and the same C heap tuning: the floor keeps every advantage the gateway has.
    keep_freed_memory()
    loop = (configured_loop_factory() or asyncio.new_event_loop)()
    web.run_app(app, host=args.host, port=args.port, print=None, loop=loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
