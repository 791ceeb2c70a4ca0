"""KServe v2 BF16: binary extension in and out (tritonclient's bytes), JSON input refused."""

from __future__ import annotations

import json
import struct
from typing import Any

from gateway_fakes import MakeGateway, echo_servable

ECHO = "/v2/models/echo/infer"
HEADER = "Inference-Header-Content-Length"
VALUES = [1.0, -2.5, 0.15625, 2.0**100, -0.0, 100.0]  # exact in bfloat16
# The wire rule tritonclient follows: the upper 2 bytes of each little-endian float32.
RAW = b"".join(struct.pack("<f", v)[2:4] for v in VALUES)


def bf16_request(size: int, *, output_binary: bool) -> tuple[bytes, dict[str, str]]:
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": "x",
                "shape": [2, 3],
                "datatype": "BF16",
                "parameters": {"binary_data_size": size},
            }
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": output_binary}}],
    }
    raw = json.dumps(header).encode()
    return raw, {HEADER: str(len(raw))}


async def test_bf16_binary_in_and_out_byte_exact(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(echo_servable("BF16", (2, 3)))
    header, headers = bf16_request(len(RAW), output_binary=True)
    resp = await gw.client.post(ECHO, data=header + RAW, headers=headers)
    assert resp.status == 200, await resp.text()
    body = await resp.read()
    n = int(resp.headers[HEADER])
    doc, blob = json.loads(body[:n]), body[n:]
    assert doc["outputs"][0] == {
        "name": "y",
        "datatype": "BF16",
        "shape": [2, 3],
        "parameters": {"binary_data_size": 12},
    }
    assert blob == RAW
    sent = gw.dispatcher.requests[0].instances[0]["x"]
    assert (sent.dtype, sent.shape, sent.data) == ("bfloat16", (2, 3), RAW)


async def test_bf16_output_as_json_is_widened_to_numbers(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(echo_servable("BF16", (2, 3)))
    header, headers = bf16_request(len(RAW), output_binary=False)
    resp = await gw.client.post(ECHO, data=header + RAW, headers=headers)
    assert resp.status == 200, await resp.text()
    out = (await resp.json())["outputs"][0]
    assert (out["datatype"], out["shape"]) == ("BF16", [2, 3])
    assert out["data"] == VALUES


async def test_bf16_binary_size_must_be_two_bytes_per_element(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(echo_servable("BF16", (2, 3)))
    header, headers = bf16_request(24, output_binary=True)
    resp = await gw.client.post(ECHO, data=header + RAW + RAW, headers=headers)
    assert resp.status == 400
    assert (await resp.json())["error"] == (
        "input 'x': binary_data_size is 24 bytes, shape [2, 3] of BF16 needs 12"
    )


async def test_fp32_sent_to_a_bf16_input_names_the_mismatch(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(echo_servable("BF16", (2, 3)))
    body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": VALUES}]}
    resp = await gw.client.post(ECHO, json=body)
    assert resp.status == 400
    assert "has datatype FP32, expected BF16" in (await resp.json())["error"]
