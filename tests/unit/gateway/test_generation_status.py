"""Running sequences and KV use on ``shardserve status`` and on the status page."""

from __future__ import annotations

from gateway_fakes import MATMUL_METHODS, servable

from shardserve.ops.launch.status import format_status
from shardserve.wire.protocol import MeshStatus, RankStatus
from shardserve_gateway.routes.observability import status_page_html


def mesh_json() -> dict[str, object]:
    rank = RankStatus(
        rank=0,
        stage=0,
        state="ready",
        kv_used_bytes=3 * 2**20,
        kv_capacity_bytes=64 * 2**20,
        sequences=2,
    )
    llm = servable("tiny", 1, (), generation=True, ranks=(rank,), running_sequences=2)
    other = servable("matmul", 1, MATMUL_METHODS, ranks=(rank,))
    status = MeshStatus(scheduler="s", time=0.0, servables=(llm, other))
    return {**status.model_dump(mode="json"), "fresh": True}


def test_status_shows_sequences_and_kv_for_generation_servables_only() -> None:
    text = format_status(mesh_json())
    tiny, matmul = text.split("matmul v1")
    assert "sequences 2 running, 0 waiting" in tiny
    assert "kv 3.0/64.0 MB (2 seq)" in tiny
    assert "sequences" not in matmul and "kv " not in matmul


def test_status_page_reads_the_generation_fields() -> None:
    page = status_page_html().decode()
    for field in ("running_sequences", "waiting_sequences", "kv_used_bytes", "kv_capacity_bytes"):
        assert field in page


async def test_readiness_turns_503_when_a_generation_servable_is_not_ready() -> None:
    from generation_fakes import gen_gateways, tiny_llm

    async with gen_gateways() as make:
        gw = await make(tiny_llm(ready=False, reason="rank 1 lost"))
        resp = await gw.client.get("/v2/health/ready")
        assert resp.status == 503
        assert "'tiny' version 1 is not ready: rank 1 lost" in (await resp.json())["error"]


async def test_a_generation_servables_model_ready_is_200_or_503() -> None:
    """Before, GET /v2/models/{m}/ready resolved a method (a generation servable has none):
    400 whether it was ready or not."""
    from generation_fakes import gen_gateways, tiny_llm

    async with gen_gateways() as make:
        ready = await make(tiny_llm())
        resp = await ready.client.get("/v2/models/tiny/ready")
        assert resp.status == 200 and (await resp.json())["ready"] is True
        resp = await ready.client.get("/v2/models/tiny/versions/1/ready")
        assert resp.status == 200
        unready = await make(tiny_llm(ready=False, reason="rank 1 lost"))
        resp = await unready.client.get("/v2/models/tiny/ready")
        assert resp.status == 503 and "rank 1 lost" in (await resp.json())["error"]
