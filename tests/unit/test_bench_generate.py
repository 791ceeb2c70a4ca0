"""The generation benchmark's pure parts: vLLM's metrics from chunk timestamps, the Poisson
schedule, prompts, SSE parsing (and over a real aiohttp stream), the targets' ratios."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

# benchmarks/ is a top-level folder of the checkout, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gen_client import (  # noqa: E402
    PROMPT_ID_RANGE,
    GenLoad,
    _take_line,
    random_prompts,
    run_gen_load,
)
from benchmarks.gen_metrics import (  # noqa: E402
    Trace,
    poisson_offsets,
    stats_ms,
    summarize_traces,
)
from benchmarks.gen_report import (  # noqa: E402
    generation_ratios,
    generation_table,
    markdown_table,
)


def trace(sent: float, chunks: list[float], done: float, tokens: int, prompt: int = 8) -> Trace:
    return Trace(sent, prompt, list(chunks), done, tokens)


# ---------------------------------------------------------------- metrics


def test_one_trace_ttft_itl_tpot_e2el() -> None:
    t = trace(10.0, [10.1, 10.15, 10.3], 10.31, 3)
    assert t.ttft == pytest.approx(0.1)
    assert t.itls == pytest.approx([0.05, 0.15])
    assert t.e2el == pytest.approx(0.31)
    assert t.tpot == pytest.approx((0.31 - 0.1) / 2)


def test_tpot_counts_tokens_not_chunks() -> None:
    # One chunk may carry several tokens: ITL is per chunk gap, TPOT per token (vLLM).
    t = trace(0.0, [0.2, 0.5], 0.5, 4)
    assert t.itls == pytest.approx([0.3])
    assert t.tpot == pytest.approx(0.3 / 3)


def test_single_token_has_no_tpot() -> None:
    assert trace(0.0, [0.2], 0.2, 1).tpot is None


def test_stats_in_ms_mean_median_p99() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    stats = stats_ms(values)
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in stats_ms([]).values())


def test_summary_throughput_over_wall_time_and_failures_left_out() -> None:
    traces = [
        trace(0.0, [0.1, 0.2, 0.3], 0.3, 3, prompt=10),
        trace(0.5, [0.7, 0.9], 1.0, 2, prompt=20),
        Trace(0.2, 10, error="HTTP 503: busy"),
    ]
    summary = summarize_traces(traces)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["first_error"] == "HTTP 503: busy"
    assert summary["duration_s"] == pytest.approx(1.0)
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_throughput"] == pytest.approx(5.0)
    assert summary["total_token_throughput"] == pytest.approx(35.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert summary["itl_ms"]["median"] == pytest.approx(100.0)  # gaps 100, 100, 200 ms
    assert summary["tpot_ms"]["mean"] == pytest.approx((100.0 + 300.0) / 2)
    assert summary["e2el_ms"]["median"] == pytest.approx(400.0)


def test_summary_of_nothing_completed() -> None:
    summary = summarize_traces([Trace(0.0, 4, error="refused")])
    assert summary["completed"] == 0
    assert summary["request_throughput"] == 0.0


# ---------------------------------------------------------------- arrivals and prompts


def test_poisson_schedule_is_seeded_increasing_and_at_the_rate() -> None:
    first = poisson_offsets(4.0, 20000, seed=7)
    assert first == poisson_offsets(4.0, 20000, seed=7)
    assert first != poisson_offsets(4.0, 20000, seed=8)
    gaps = np.diff([0.0, *first])
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean


def test_infinite_rate_sends_everything_at_once_and_bad_rate_is_refused() -> None:
    assert poisson_offsets(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_offsets(2.0, 0, seed=0) == []
    with pytest.raises(ValueError):
        poisson_offsets(0.0, 3, seed=0)


def test_random_prompts_have_the_fixed_length_in_range() -> None:
    prompts = random_prompts(5, 128, seed=3)
    assert [len(p) for p in prompts] == [128] * 5
    low, high = PROMPT_ID_RANGE
    assert all(low <= t < high for p in prompts for t in p)
    assert prompts == random_prompts(5, 128, seed=3)
    assert prompts[0] != prompts[1]


def test_load_labels() -> None:
    assert GenLoad(128, 128, 4, 1).label == "in128-out128.c1"
    assert GenLoad(32, 64, 32, 32, rate=4.0).label == "in32-out64.c32.rate4"


# ---------------------------------------------------------------- the stream


def test_sse_lines_time_text_chunks_only() -> None:
    t = Trace(0.0, 4)
    chunk = {"choices": [{"index": 0, "text": " hi"}]}
    _take_line(t, b"data: " + json.dumps(chunk).encode() + b"\n", 1.0)
    _take_line(t, b"\n", 1.1)
    held = {"choices": [{"index": 0, "text": ""}]}  # bytes held back: no token shown yet
    _take_line(t, b"data: " + json.dumps(held).encode() + b"\n", 1.2)
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    _take_line(t, b"data: " + json.dumps(usage).encode() + b"\n", 1.3)
    _take_line(t, b"data: [DONE]\n", 1.4)
    assert t.chunk_times == [1.0]
    assert t.output_tokens == 2
    assert not t.error


def test_sse_error_chunk_fails_the_trace() -> None:
    t = Trace(0.0, 4)
    _take_line(t, b'data: {"error": {"message": "rank lost", "code": "rank_lost"}}\n', 1.0)
    assert "rank lost" in t.error


def _streaming_app(gap_s: float, received: list[dict[str, Any]]) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(body["max_tokens"]):
            await asyncio.sleep(gap_s)
            chunk = {"choices": [{"index": 0, "text": f" w{index}"}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_client_measures_a_real_stream() -> None:
    received: list[dict[str, Any]] = []

    async def scenario() -> list[Trace]:
        async with TestServer(_streaming_app(0.02, received)) as server:
            load = GenLoad(16, 5, requests=3, max_concurrency=2, warmup=1)
            return await run_gen_load(str(server.make_url("")).rstrip("/"), "m", load)

    traces = asyncio.run(scenario())
    assert len(received) == 4  # one warm-up, three measured
    assert all(b["stream"] and b["ignore_eos"] and len(b["prompt"]) == 16 for b in received)
    summary = summarize_traces(traces)
    assert (summary["completed"], summary["output_tokens"], summary["prompt_tokens"]) == (3, 15, 48)
    assert summary["itl_ms"]["median"] >= 15.0  # the server's 20 ms gaps, timer slack allowed
    assert summary["ttft_ms"]["median"] >= 15.0


def test_client_records_http_errors() -> None:
    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def scenario() -> list[Trace]:
        app = web.Application()
        app.router.add_post("/v1/completions", refuse)
        async with TestServer(app) as server, aiohttp.ClientSession():
            load = GenLoad(4, 2, requests=2, max_concurrency=1, warmup=0)
            return await run_gen_load(str(server.make_url("")).rstrip("/"), "m", load)

    traces = asyncio.run(scenario())
    assert [t.error[:8] for t in traces] == ["HTTP 503"] * 2
    assert summarize_traces(traces)["failed"] == 2


# ---------------------------------------------------------------- targets


def _load(itl: float, out_tps: float) -> dict[str, Any]:
    stats = {"mean": itl, "median": itl, "p99": itl}
    return {
        "completed": 1,
        "failed": 0,
        "itl_ms": stats,
        "ttft_ms": stats,
        "tpot_ms": stats,
        "e2el_ms": stats,
        "request_throughput": 1.0,
        "output_throughput": out_tps,
        "total_token_throughput": out_tps,
    }


def test_generation_ratios_from_one_run() -> None:
    one, many = "in32-out64.c1", "in32-out64.c32"
    memory = {"r0": {"rss_mb": 300.0, "slice_mb": 80.0, "kv_budget_mb": 256.0}}
    results: dict[str, Any] = {
        "gen.targets": {"small.c1": one, "large.c1": one, "large.c32": many},
        f"gen.small.mesh-tp1.{one}": _load(12.0, 80.0),
        f"gen.small.floor.{one}": _load(10.0, 100.0),
        f"gen.large.mesh-tp1.{one}": _load(44.0, 20.0),
        f"gen.large.floor.{one}": _load(40.0, 25.0),
        f"gen.large.floor-b32.{many}": _load(100.0, 300.0),
        f"gen.large.mesh-tp1.{many}": _load(150.0, 180.0),
        f"gen.large.peer.{one}": _load(50.0, 15.0),
        f"gen.large.mesh-tp2.{one}": _load(30.0, 30.0),
        "gen.small.mesh-tp1.memory": {**memory, "r0": {**memory["r0"], "kv_bytes_per_token": 1}},
        "gen.large.mesh-tp1.memory": {
            "r0": {
                "rss_mb": 1000.0,
                "slice_mb": 600.0,
                "kv_budget_mb": 256.0,
                "kv_bytes_per_token": 16384,
            }
        },
        "gen.large.mesh-tp2.memory": {
            f"r{r}": {"rss_mb": 1, "slice_mb": 1, "kv_budget_mb": 1, "kv_bytes_per_token": 8192}
            for r in (0, 1)
        },
    }
    ratios = {r.name: r for r in generation_ratios(results)}
    assert ratios["gen small: mesh TP1 ITL - floor ITL (ms, 1 seq)"].value == pytest.approx(2.0)
    assert ratios["gen small: mesh TP1 ITL - floor ITL (ms, 1 seq)"].passed is False
    assert ratios["gen large: mesh TP1 ITL / floor ITL (1 seq)"].value == pytest.approx(1.1)
    assert ratios["gen large: mesh c32 / mesh c1 output tok/s"].value == pytest.approx(9.0)
    assert ratios["gen large: mesh c32 / peer output tok/s"].value == pytest.approx(12.0)
    assert ratios["gen large: TP2 ITL / TP1 ITL (1 seq, 1 thread/rank)"].passed is False
    rss = ratios["gen large: (agent RSS - overhead) / (slice + KV budget)"]
    assert rss.value == pytest.approx((1000.0 - 220.0) / 856.0)  # overhead 300 - 80
    assert ratios["gen large: KV bytes/token per rank, TP2 / TP1"].value == pytest.approx(0.5)
    table = generation_table(results)
    assert table[0].startswith("generation load")
    assert any(line.startswith(f"large.mesh-tp1.{many}") for line in table)
    markdown = markdown_table(results)
    assert len(markdown) == 2 + 8  # header, rule, one row per load
    assert f"| large.mesh-tp1.{many} | 150.0 / 150.0 / 150.0 |" in "\n".join(markdown)


def test_no_generation_run_no_ratios() -> None:
    assert generation_ratios({"mesh1.json.c1": {"rps": 1.0}}) == []
    assert generation_table({}) == []


def test_step_budget_per_rank_from_two_readings() -> None:
    from benchmarks.gen_scenario import step_budget

    before = {"r0": {"jobs_done": 10.0, "compute_ms_total": 100.0, "collective_ms_total": 50.0}}
    after = {
        "r0": {"jobs_done": 30.0, "compute_ms_total": 300.0, "collective_ms_total": 450.0},
        "r1": {"jobs_done": 0.0, "compute_ms_total": 0.0, "collective_ms_total": 0.0},
    }
    budget = step_budget(before, after)
    assert budget == {"r0": {"steps": 20.0, "compute_ms": 10.0, "collective_ms": 20.0}}


@pytest.fixture(scope="module")
def llama_floor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from benchmarks.gen_floor import FloorModel

    from shardserve.tools.export.hf import export_hf

    repo = tmp_path_factory.mktemp("floor")
    export_hf(ROOT / "tests" / "fixtures" / "hf" / "llama", repo, rank_size=1, stage_size=1)
    return FloorModel(repo, "llama", 1 << 24)


def _llama_reference() -> list[dict[str, Any]]:
    path = ROOT / "tests" / "fixtures" / "hf" / "llama" / "reference.json"
    prompts: list[dict[str, Any]] = json.loads(path.read_text())["prompts"]
    return prompts


def test_floor_greedy_equals_transformers_one_at_a_time_and_batched(llama_floor: Any) -> None:
    """The floor's loop (real onnxruntime, the runtime's KV cache) makes transformers' greedy
    continuations, alone and as one static batch of prompts of different lengths."""
    from benchmarks.gen_floor import generate_batch

    reference = _llama_reference()
    prompts = [p["input_ids"] for p in reference]
    wanted = [p["greedy_ids"][:8] for p in reference]
    alone = [generate_batch(llama_floor, [p], 8, 10 * i)[1][0] for i, p in enumerate(prompts)]
    traces, batched = generate_batch(llama_floor, prompts, 8, 100)
    assert alone == wanted
    assert batched == wanted
    assert all(t.ok and t.output_tokens == 8 and len(t.chunk_times) == 8 for t in traces)
    assert llama_floor.cache.used_bytes == 0  # every sequence freed
