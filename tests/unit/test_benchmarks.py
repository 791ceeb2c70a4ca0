"""The benchmark harness pieces on tiny inputs (no timing assertions, no broker)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from shardserve.client.kserve import decode_response

# benchmarks/ is a top-level folder of the checkout, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import floor_server, gateway_alone  # noqa: E402
from benchmarks.bodies import binary_body, json_body, make_body  # noqa: E402
from benchmarks.ceilings import batching_ceiling, pipeline_ceiling  # noqa: E402
from benchmarks.loadgen import LoadSpec, percentile, run_load, summarize  # noqa: E402
from benchmarks.report import (  # noqa: E402
    Ratio,
    allreduce_lines,
    compute_ratios,
    per_hop_ms,
    render,
    write_json,
)
from benchmarks.rounds import combine_ratios, combine_results, median_entry  # noqa: E402
from benchmarks.scenarios import SCENARIOS  # noqa: E402


def test_percentile_interpolates_and_handles_edges() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert math.isnan(percentile([], 50))


def test_summarize_orders_latencies() -> None:
    result = summarize(4, [3.0, 1.0, 2.0], errors=1, elapsed_s=2.0, first_error="boom")
    assert result.latencies_ms == [1.0, 2.0, 3.0]
    assert result.p50_ms == 2.0
    assert result.rps == pytest.approx(1.5)
    data = result.to_json()
    assert data["errors"] == 1 and "latencies_ms" not in data


class FakeClock:
    """Advances by a fixed step at every read, so run_load needs no real time."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def test_run_load_excludes_warmup_and_counts_errors() -> None:
    calls = 0

    async def call() -> bool:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if calls % 5 == 0:
            raise RuntimeError("every fifth fails")
        return True

    clock = FakeClock(0.01)
    result = await run_load(call, LoadSpec(concurrency=3, duration_s=1.0, warmup_s=0.5), clock)
    assert result.requests > 0
    assert result.errors > 0
    assert "every fifth fails" in result.first_error
    assert result.requests + result.errors < calls  # the warm-up calls are not counted


async def test_run_load_stops_at_max_requests() -> None:
    async def call() -> bool:
        await asyncio.sleep(0)
        return True

    spec = LoadSpec(concurrency=1, duration_s=1e9, warmup_s=0.0, max_requests=7)
    result = await run_load(call, spec, FakeClock(0.001))
    assert result.requests == 7


def test_bodies_are_valid_kserve() -> None:
    inputs = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    body = json.loads(json_body(inputs).data)
    assert body["inputs"][0] == {
        "name": "x",
        "shape": [2, 3],
        "datatype": "FP32",
        "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    }
    binary = binary_body(inputs)
    length = int(binary.headers["Inference-Header-Content-Length"])
    header = json.loads(binary.data[:length])
    assert header["inputs"][0]["parameters"]["binary_data_size"] == 24
    assert binary.data[length:] == inputs["x"].tobytes()
    with pytest.raises(ValueError):
        make_body("xml", inputs)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    import onnx

    from shardserve.tools.export.matmul import reference_model

    path = tmp_path / "matmul.onnx"
    onnx.save(reference_model(), str(path))
    return path


@pytest.mark.parametrize("reading", ["fast", "numeric", "stdlib"])
@pytest.mark.parametrize("kind", ["json", "binary"])
async def test_floor_server_answers_the_demo_model(
    tiny_model: Path, kind: str, reading: str
) -> None:
    body = make_body(kind, {"x": np.ones((128, 96), dtype=np.float32)})
    app = floor_server.create_app(tiny_model, json_reading=reading)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/v2/health/ready")).status == 200
        response = await client.post(
            "/v2/models/matmul/infer", data=body.data, headers=body.headers
        )
        assert response.status == 200
        payload = await response.read()
        outputs = decode_response(payload, response.headers.get("Inference-Header-Content-Length"))
    np.testing.assert_allclose(outputs["y"], np.full((128, 16), -48.0, dtype=np.float32))


@pytest.mark.parametrize("variant", gateway_alone.VARIANTS)
async def test_gateway_alone_variants_answer_the_demo_body(variant: str) -> None:
    body = make_body("binary", {"x": np.ones((128, 96), dtype=np.float32)})
    async with TestClient(TestServer(gateway_alone.create_app(variant))) as client:
        assert (await client.get("/v2/health/ready")).status == 200
        response = await client.post(
            "/v2/models/matmul/infer", data=body.data, headers=body.headers
        )
        assert response.status == 200
        payload = await response.read()
    if variant == "gateway":  # the real gateway's encoding of the in-process answer
        header = response.headers.get("Inference-Header-Content-Length")
        outputs = decode_response(payload, header)
        np.testing.assert_array_equal(outputs["y"], np.full((128, 16), -48.0, np.float32))
    else:
        assert len(payload) > 128 * 16 * 4


def test_gateway_cost_is_set_beside_the_bare_handler_and_the_mesh() -> None:
    results = {
        "gateway-alone.gateway.binary.c32": {"cpu_ms_per_request": {"gateway": 0.3, "loadgen": 1}},
        "gateway-alone.bare.binary.c32": {"cpu_ms_per_request": {"bare": 0.1, "loadgen": 1.0}},
        "mesh1.binary.c32": {"cpu_ms_per_request": {"gateway": 0.3, "gateway.1": 0.32}},
    }
    (ratio,) = [r for r in compute_ratios(results) if r.name.startswith("gateway alone")]
    assert ratio.value == pytest.approx(3.0) and ratio.target == "-"
    assert "0.3 ms" in ratio.detail and "0.1 ms" in ratio.detail and "0.62 ms" in ratio.detail


def test_ratios_from_results() -> None:
    results = {
        "floor.json.c1": {"rps": 100.0, "p50_ms": 2.0, "requests": 10},
        "floor.json.c32": {"rps": 200.0, "p50_ms": 20.0, "requests": 10},
        "mesh1.json.c1": {"rps": 80.0, "p50_ms": 4.0, "requests": 10},
        "mesh1.json.c32": {"rps": 180.0, "p50_ms": 25.0, "requests": 10},
        "broker.c1": {"rps": 500.0, "p50_ms": 1.0, "requests": 10},
        "memory": {
            "matmul.r0": {"rss_mb": 50.0, "slice_mb": 0.1},
            "mlp.r0": {"rss_mb": 120.0, "slice_mb": 64.0},
        },
    }
    ratios = {r.name: r for r in compute_ratios(results)}
    throughput = ratios["mesh rank1 JSON c32 / floor JSON c32 (req/s)"]
    assert throughput.value == pytest.approx(0.9) and throughput.passed is True
    assert ratios["mesh rank1 c1 p50 - floor c1 p50 (ms, JSON)"].value == pytest.approx(2.0)
    mesh_hop, raw_hop = per_hop_ms(results)
    assert mesh_hop == pytest.approx(0.5) and raw_hop == pytest.approx(0.5)
    assert ratios["mesh cost per broker hop / raw one-hop"].value == pytest.approx(1.0)
    assert ratios["agent (RSS - overhead) / slice weights"].value == pytest.approx(70 / 64)
    assert ratios["TP8 JSON c32 / mesh rank1 JSON c32 (req/s)"].passed is None  # not measured
    assert not any("stdlib" in name or "numeric" in name for name in ratios)  # not run
    assert "n/a" in render(results, list(ratios.values()), ["a note"])


def _linear_onnx(path: Path, width: int) -> Path:
    """x[N, width] @ W[width, width], a batch dimension left free."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.eye(width, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_ceilings_measure_rows_per_second_of_the_model_itself(tmp_path: Path) -> None:
    model = _linear_onnx(tmp_path / "m.onnx", 8)
    batching = batching_ceiling(model, 4, 0.05)
    assert batching["rows_per_s_1"] > 0 and batching["rows_per_s_4"] > 0
    assert batching["ratio"] == pytest.approx(batching["rows_per_s_4"] / batching["rows_per_s_1"])
    pipeline = pipeline_ceiling([model, model], 0.05)
    assert pipeline["rows_per_s_serial"] > 0 and pipeline["rows_per_s_concurrent"] > 0
    expected = pipeline["rows_per_s_concurrent"] / pipeline["rows_per_s_serial"]
    assert pipeline["ratio"] == pytest.approx(expected)


def test_ceilings_are_shown_beside_their_targets_without_a_verdict() -> None:
    results = {"mlp.ceiling": {"ratio": 5.5}, "pipeline.ceiling": {"ratio": 1.9}}
    ratios = {r.name: r for r in compute_ratios(results)}
    batching = ratios["MLP compute alone, 32-row / 1-row runs (rows/s)"]
    pipeline = ratios["2 stage slices at once / one after another (rows/s)"]
    assert batching.value == 5.5 and pipeline.value == 1.9
    assert batching.passed is None and pipeline.passed is None


def test_ratios_against_the_stdlib_floor_too() -> None:
    results = {
        "floor.json.c32": {"rps": 200.0, "p50_ms": 20.0, "requests": 10},
        "floor-stdlib.json.c32": {"rps": 100.0, "p50_ms": 40.0, "requests": 10},
        "mesh1.json.c32": {"rps": 90.0, "p50_ms": 25.0, "requests": 10},
    }
    ratios = {r.name: r.value for r in compute_ratios(results)}
    assert ratios["mesh rank1 JSON c32 / floor JSON c32 (req/s)"] == pytest.approx(0.45)
    stdlib = "mesh rank1 JSON c32 / stdlib floor JSON c32 (req/s)"
    assert ratios[stdlib] == pytest.approx(0.9)


def test_ratio_verdicts() -> None:
    assert Ratio("a", 0.7, ">= 0.8", "").passed is False
    assert Ratio("b", 1.0, "<= 1.5", "").passed is True
    assert Ratio("c", None, "<= 1.5", "").passed is None


def test_write_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "abc.json"
    write_json(out, {"x": {"rps": 1.0}}, compute_ratios({}), {"commit": "abc"})
    doc = json.loads(out.read_text())
    assert doc["meta"]["commit"] == "abc"
    assert doc["results"]["x"]["rps"] == 1.0
    assert all(r["passed"] is None for r in doc["ratios"])


def test_every_documented_scenario_is_registered() -> None:
    expected = {"direct", "floor", "floor-stdlib", "broker", "mesh1", "tp8", "pp16", "batching"}
    expected |= {"pipeline", "floor-numeric", "gateway-alone"}
    expected |= {"memory", "large", "allreduce", "cache", "generate", "quality", "grpc", "real"}
    assert expected == set(SCENARIOS)


def test_allreduce_lines_pair_the_algorithms_in_size_order() -> None:
    results = {
        "allreduce.r4.sharded.16384KiB": {"ms_per_allreduce": 100.0},
        "allreduce.r4.leader.16384KiB": {"ms_per_allreduce": 200.0},
        "allreduce.r4.leader.256KiB": {"ms_per_allreduce": 5.0},
        "allreduce.r4.sharded.256KiB": {"ms_per_allreduce": 10.0},
        "allreduce.r8.leader.1024KiB": {"ms_per_allreduce": 30.0},  # no sharded pair: skipped
    }
    assert allreduce_lines(results) == [
        "allreduce 4 ranks, 256 KiB parts: leader 5 ms, sharded 10 ms, leader/sharded 0.5",
        "allreduce 4 ranks, 16384 KiB parts: leader 200 ms, sharded 100 ms, leader/sharded 2",
    ]


def test_cpu_meter_counts_this_process() -> None:
    from benchmarks.meshes import CpuMeter, cpu_seconds

    meter = CpuMeter({"me": os.getpid()})
    total = 0
    for i in range(300_000):  # burn a little CPU so the counter moves by a tick
        total += i * i
    assert total > 0
    assert cpu_seconds(os.getpid()) > 0
    assert meter.per_request(0) == {}
    assert set(meter.per_request(10)) == {"me"}


def test_py_spy_collapsed_stacks_are_summarized() -> None:
    from benchmarks.profile import parse_collapsed, summarize_profile

    text = (
        "main (app.py:1);decode_request (kserve_codec.py:9);loads (__init__.py:3) 6\n"
        "main (app.py:1);publish_raw (broker.py:5) 4\n"
    )
    total, inclusive, leaves = parse_collapsed(text)
    assert total == 10
    assert inclusive[("decode_request", "kserve_codec.py")] == 6
    assert leaves["publish_raw (broker.py)"] == 4
    lines = summarize_profile("gateway", text, seconds=1.0, rate=100)
    assert any("60.0%  decode_request" in line for line in lines)


def test_profile_exports_the_mesh_its_options_name(tmp_path: Path) -> None:
    from benchmarks.profile import _export

    args = argparse.Namespace(model="matmul", rank_size=2, stage_size=2, body="binary")
    body = _export(args, tmp_path / "repo")
    group = json.loads((tmp_path / "repo" / "matmul" / "1" / "group.json").read_text())
    assert (group["rank_size"], group["stage_size"]) == (2, 2)
    assert body.kind == "binary"


def test_agent_load_lines_are_parsed() -> None:
    from benchmarks.scenarios import loaded_from_log

    line = (
        "[agent t r1] ... rank 1 slice loaded: 9 segment(s), 9.1 MB on disk, "
        "compile cache miss (standard), 0 shared weight(s) of 0.0 MB, 281 ms"
    )
    assert loaded_from_log(f"noise\n{line}\n") == [(281.0, "miss")]


def _load(rps: float, p50: float) -> dict[str, float]:
    return {"rps": rps, "p50_ms": p50, "p99_ms": p50 * 2, "requests": 10, "errors": 0}


def test_rounds_keep_the_median_round_of_each_measurement_whole() -> None:
    rounds = [
        {"floor.json.c32": _load(500, 60), "mlp.ceiling": {"ratio": 6.0}, "note": "a"},
        {"floor.json.c32": _load(733, 40), "mlp.ceiling": {"ratio": 8.0}},
        {"floor.json.c32": _load(650, 50), "mlp.ceiling": {"ratio": 7.0}, "note": "c"},
    ]
    combined = combine_results(rounds)
    assert combined["floor.json.c32"] == _load(650, 50)  # rps, p50, p99 of one round
    assert combined["mlp.ceiling"] == {"ratio": 7.0}
    assert combined["note"] == "a"  # not a measurement: the first round that has it
    assert list(combined) == ["floor.json.c32", "mlp.ceiling", "note"]
    # an even count takes the lower middle round, still a real one
    assert median_entry([_load(1, 1), _load(4, 4), _load(2, 2), _load(3, 3)]) == _load(2, 2)


def test_rounds_report_the_median_ratio_and_every_round_beside_it() -> None:
    def round_with(mesh_rps: float) -> dict[str, Any]:
        return {"floor.json.c32": _load(1000, 10), "mesh1.json.c32": _load(mesh_rps, 30)}

    ratios = combine_ratios([round_with(500), round_with(900), round_with(700)])
    [floor_ratio] = [r for r in ratios if r.name.startswith("mesh rank1 JSON c32 / floor")]
    assert floor_ratio.value == pytest.approx(0.7)
    assert floor_ratio.passed is False
    assert floor_ratio.detail.endswith("rounds: 0.5, 0.9, 0.7")
    unmeasured = [r for r in ratios if r.name.startswith("TP8")]
    assert unmeasured[0].value is None
    single = combine_ratios([round_with(900)])
    assert single == compute_ratios(round_with(900))  # one round: exactly as before


def test_processes_of_one_module_get_numbered_names() -> None:
    from benchmarks.meshes import numbered_name

    taken = {"gateway": 1, "scheduler": 2}
    assert numbered_name("agent.r0", taken) == "agent.r0"
    assert numbered_name("gateway", taken) == "gateway.1"
    assert numbered_name("gateway", {**taken, "gateway.1": 3}) == "gateway.2"
