"""Versions and counts in URLs, queries, parameters and headers: only ASCII digits count.

``str.isdigit()`` took ``'¹'`` (then ``int()`` refused it: a 500) and ``int()`` took
``'٣'`` as 3. Every route that reads a number from text answers 400 (or 404 for a
version that is well written but unknown) with a message, never 500, and never reads a
Unicode digit as a version."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gateway_fakes import MATMUL_METHODS, Gateway, MakeGateway, servable

# Superscript one, Arabic-Indic three, fullwidth one, signs, spaces, empty, too long.
BAD_NUMBERS = ["¹", "٣", "１", "+1", "-1", " 1", "1 ", "1_0", "0x1", "", "9" * 19, "9" * 5000]
BAD_URL_VERSIONS = [v for v in BAD_NUMBERS if v and v.strip() == v]  # a URL segment
KSERVE_SUFFIXES = ["", "/ready", "/infer"]
INFER_BODY = {"inputs": [{"name": "x", "shape": [1, 96], "datatype": "FP32", "data": [1.0] * 96}]}


async def _kserve(gateway: Gateway, version: str, suffix: str) -> tuple[int, dict[str, Any]]:
    path = f"/v2/models/matmul/versions/{version}{suffix}"
    if suffix == "/infer":
        resp = await gateway.client.post(path, json=INFER_BODY)
    else:
        resp = await gateway.client.get(path)
    return resp.status, await resp.json()


@pytest.mark.parametrize("suffix", KSERVE_SUFFIXES)
@pytest.mark.parametrize("version", BAD_URL_VERSIONS)
async def test_kserve_bad_versions_are_400_naming_the_problem(
    gateway: Gateway, version: str, suffix: str
) -> None:
    status, body = await _kserve(gateway, version, suffix)
    assert status == 400, body
    assert body["code"] == "bad_input"
    assert "model version must be a positive integer in ASCII digits" in body["error"]
    assert gateway.dispatcher.requests == []


@pytest.mark.parametrize("suffix", KSERVE_SUFFIXES)
async def test_kserve_zero_is_400_and_an_unknown_version_404(gateway: Gateway, suffix: str) -> None:
    zero_status, zero = await _kserve(gateway, "0", suffix)
    assert (zero_status, zero["code"]) == (400, "bad_input")
    status, body = await _kserve(gateway, "3", suffix)
    assert (status, body["code"]) == (404, "not_found")
    assert "unknown version 3 of model 'matmul'" in body["error"]


async def test_kserve_arabic_three_is_not_version_three(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(servable("matmul", 3, MATMUL_METHODS))
    assert (await _kserve(gw, "3", ""))[0] == 200
    assert (await _kserve(gw, "003", ""))[0] == 200  # leading zeros: still version 3
    assert (await _kserve(gw, "٣", ""))[0] == 400


async def _mindspore(gateway: Gateway, version: str) -> tuple[int, dict[str, Any]]:
    body = {"instances": [{"x": np.ones((128, 96)).tolist()}]}
    resp = await gateway.client.post(f"/model/matmul/version/{version}:predict", json=body)
    return resp.status, await resp.json()


@pytest.mark.parametrize("version", [v for v in BAD_URL_VERSIONS if not v.isdigit()])
async def test_mindspore_bad_versions_are_400(gateway: Gateway, version: str) -> None:
    status, body = await _mindspore(gateway, version)
    assert status == 400, body
    assert "keyword:[version] value invalid" in body["error_msg"]


@pytest.mark.parametrize("version", ["¹", "٣", "１"])
async def test_mindspore_unicode_digits_are_invalid_not_a_version(
    gateway: Gateway, version: str
) -> None:
    status, body = await _mindspore(gateway, version)
    assert status == 400, body
    assert "keyword:[version] value invalid" in body["error_msg"]


@pytest.mark.parametrize("version", ["4294967295", "9" * 19, "9" * 5000])
async def test_mindspore_too_large_versions_are_out_of_range(
    gateway: Gateway, version: str
) -> None:
    status, body = await _mindspore(gateway, version)
    assert status == 400, body
    assert "version number range failed" in body["error_msg"]


async def test_mindspore_version_zero_means_the_highest_and_7_is_unknown(
    gateway: Gateway,
) -> None:
    assert (await _mindspore(gateway, "0"))[0] == 200
    assert gateway.dispatcher.requests[-1].version == 2
    status, body = await _mindspore(gateway, "7")
    assert status == 404
    assert "unknown version 7" in body["error_msg"]


@pytest.mark.parametrize("version", BAD_NUMBERS)
async def test_repository_command_text_versions_are_400(gateway: Gateway, version: str) -> None:
    resp = await gateway.client.post(
        "/v2/repository/models/matmul/unload", json={"parameters": {"version": version}}
    )
    body = await resp.json()
    assert resp.status == 400, body
    assert body["code"] == "bad_input"
    assert "parameter 'version' must be a positive integer" in body["error"]
    assert gateway.dispatcher.commands == []


async def test_repository_command_versions_as_text_or_number(gateway: Gateway) -> None:
    for version in ("2", 2, "0", 0):
        resp = await gateway.client.post(
            "/v2/repository/models/matmul/unload", json={"parameters": {"version": version}}
        )
        assert resp.status == 200, await resp.json()
    assert [c.version for c in gateway.dispatcher.commands] == [2, 2, 0, 0]


@pytest.mark.parametrize("last", BAD_NUMBERS + ["0"])
async def test_timeseries_bad_last_is_400(gateway: Gateway, last: str) -> None:
    resp = await gateway.client.get("/api/timeseries", params={"last": last})
    body = await resp.json()
    assert resp.status == 400, body
    assert "query 'last' must be a positive integer in ASCII digits" in body["error"]


async def test_timeseries_last_limits_the_span(gateway: Gateway) -> None:
    short = await (await gateway.client.get("/api/timeseries", params={"last": "5"})).json()
    whole = await (await gateway.client.get("/api/timeseries")).json()
    assert len(short["points"]) == 5
    assert len(whole["points"]) > 5


@pytest.mark.parametrize("header", ["¹", "٣", "+4", "-4", "4.0", "9" * 5000])
async def test_binary_header_length_in_unicode_digits_is_400(gateway: Gateway, header: str) -> None:
    resp = await gateway.client.post(
        "/v2/models/matmul/infer",
        data=b'{"inputs": []}' + b"\0" * 8,
        headers={"Inference-Header-Content-Length": header, "Content-Type": "application/json"},
    )
    body = await resp.json()
    assert resp.status == 400, body
    assert "Unable to parse Inference-Header-Content-Length" in body["error"]
