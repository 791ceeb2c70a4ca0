"""/metrics for generations: token histograms and counters measured at the gateway, and
running/waiting sequences and KV use re-exported from the mesh status."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from generation_fakes import MakeGenGateway, chunks_of, gen_gateways, tiny_llm

from shardserve.wire.protocol import RankStatus, Usage
from shardserve_gateway.generation.metrics import GenerationMetrics, StreamTiming


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_token_metrics_after_a_streamed_and_a_whole_generation(
    make_gen_gateway: MakeGenGateway,
) -> None:
    gw = await make_gen_gateway(delay_s=0.01)
    for stream in (True, False):
        body = {"model": "tiny", "prompt": "x", "stream": stream}
        resp = await gw.client.post("/v1/completions", json=body)
        await resp.read()
    text = await (await gw.client.get("/metrics")).text()
    s = '{servable="tiny"}'
    assert sample(text, f"shardserve_gateway_time_to_first_token_seconds_count{s}") == 2
    assert sample(text, f"shardserve_gateway_inter_token_latency_seconds_count{s}") == 10
    assert sample(text, f"shardserve_gateway_time_per_output_token_seconds_count{s}") == 2
    assert sample(text, f"shardserve_gateway_prompt_tokens_total{s}") == 6
    assert sample(text, f"shardserve_gateway_generation_tokens_total{s}") == 12
    itl_mean = sample(text, f"shardserve_gateway_inter_token_latency_seconds_sum{s}") / 10
    assert 0.005 < itl_mean < 0.5  # the scripted 10 ms between chunks, seen at the gateway
    fast = '{servable="tiny",le="0.001"}'
    assert sample(text, f"shardserve_gateway_inter_token_latency_seconds_bucket{fast}") == 0
    ok = '{servable="tiny",method="generate",status="200"}'
    assert sample(text, f"shardserve_gateway_requests_total{ok}") == 2


async def test_sequences_and_kv_from_the_mesh_status(make_gen_gateway: MakeGenGateway) -> None:
    rank = RankStatus(
        rank=0, stage=0, state="ready", kv_used_bytes=1024, kv_capacity_bytes=4096, sequences=2
    )
    gw = await make_gen_gateway(tiny_llm(running_sequences=2, waiting_sequences=1, ranks=(rank,)))
    text = await (await gw.client.get("/metrics")).text()
    sv = '{servable="tiny",version="1"}'
    rl = '{servable="tiny",version="1",rank="0",stage="0"}'
    assert sample(text, f"shardserve_servable_running_sequences{sv}") == 2
    assert sample(text, f"shardserve_servable_waiting_sequences{sv}") == 1
    assert sample(text, f"shardserve_rank_kv_used_bytes{rl}") == 1024
    assert sample(text, f"shardserve_rank_kv_capacity_bytes{rl}") == 4096
    assert sample(text, f"shardserve_rank_sequences{rl}") == 2


def test_timing_is_measured_from_chunk_arrivals() -> None:
    now = [10.0]
    metrics = GenerationMetrics()
    timing = StreamTiming(metrics, "m", clock=lambda: now[0])
    chunks = chunks_of(["a", "", "b"])
    for arrival, chunk in zip((10.5, 10.6, 10.9), chunks, strict=True):
        now[0] = arrival
        timing.chunk(chunk)
    assert metrics.histograms["ttft"]["m"].total == pytest.approx(0.5)
    assert metrics.histograms["itl"]["m"].total == pytest.approx(0.4)
    assert metrics.histograms["tpot"]["m"].total == pytest.approx(0.2)
    assert chunks[-1].usage == Usage(prompt_tokens=3, completion_tokens=3)
    assert metrics.tokens["generated"]["m"] == 3
