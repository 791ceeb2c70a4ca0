"""Decode runs through a real mesh (`shardserve up` on the llama fixture at TP 1 and TP 2,
real RabbitMQ, onnxruntime, agents): with --max-decode-steps 8 greedy text equals
transformers', seeded sampling gives the text a mesh with --max-decode-steps 1 gives, and
4 concurrent sequences of different lengths each give their alone text. The ranks' step
counts show that the runs happened (fewer StepWorks than tokens)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shardserve.ops.child_mesh import LocalMesh, isolated_vhost
from shardserve.tools.export.hf import export_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conditions import beaten_since, wait_until
from generation_http import FIXTURE, REFERENCE, idle, start_mesh

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

SERVABLES = ("llama_tp1", "llama_tp2")
PROMPTS = REFERENCE["prompts"]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
SEEDED_TOKENS = 40
# The run length is then set by max-decode-steps and the tokens left, not by how busy the
# machine is (with the default 50 ms a step slowed down by other processes shortens the
# runs that follow; a test asserting their length would be flaky).
RUNS_ENV = {
    "SHARDSERVE_SCHEDULER_MAX_DECODE_STEPS": "8",
    "SHARDSERVE_SCHEDULER_DECODE_RUN_MS": "1000000",
}
Texts = dict[tuple[str, int], str]  # (servable, prompt index) -> text


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, folder, rank_size=1, name="llama_tp1")
    export_hf(FIXTURE, folder, rank_size=2, name="llama_tp2")
    return folder


@pytest.fixture(scope="module")
def single_step_texts(amqp_url: str, repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Texts:
    """The seeded texts of a mesh that runs one decode step per StepWork (stopped before
    the mesh under test starts: two cores)."""
    log = tmp_path_factory.mktemp("mesh-k1") / "mesh.log"
    with isolated_vhost(amqp_url, "shardserve-test") as url:
        mesh = start_mesh(repo, url, log, env={"SHARDSERVE_SCHEDULER_MAX_DECODE_STEPS": "1"})
        try:
            return asyncio.run(seeded_texts(mesh))
        finally:
            mesh.stop()


@pytest.fixture(scope="module")
def mesh(
    isolated_amqp_url: str,
    repo: Path,
    single_step_texts: Texts,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalMesh]:
    log = tmp_path_factory.mktemp("mesh-k8") / "mesh.log"
    mesh = start_mesh(repo, isolated_amqp_url, log, env=RUNS_ENV)
    try:
        # The first decode step of a version is never a run (it is timed): take it here.
        for servable in SERVABLES:
            asyncio.run(complete(mesh, servable, "warm up", 30, temperature=0.0))
        yield mesh
    finally:
        mesh.stop()


async def complete(mesh: LocalMesh, servable: str, prompt: str, n: int, **sampling: Any) -> str:
    """The whole text of one completion of exactly ``n`` tokens."""
    async with openai.AsyncOpenAI(
        base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0
    ) as client:
        done = await client.completions.create(
            model=servable,
            prompt=prompt,
            max_tokens=n,
            extra_body={"ignore_eos": True},
            **sampling,
        )
    assert done.usage is not None and done.usage.completion_tokens == n
    assert done.choices[0].finish_reason == "length"
    return done.choices[0].text


async def seeded_texts(mesh: LocalMesh) -> Texts:
    return {
        (servable, i): await complete(mesh, servable, p["text"], SEEDED_TOKENS, **SEEDED)
        for servable in SERVABLES
        for i, p in enumerate(PROMPTS)
    }


def steps_done(mesh: LocalMesh, servable: str) -> int:
    """StepWorks the servable's first rank has run so far, once nothing runs (in a status
    with heartbeats newer than the last step, not one from before it)."""
    since = mesh.status()["time"]

    def settled() -> dict[str, Any] | None:
        status: dict[str, Any] = mesh.status()
        return status if beaten_since(status, servable, since) and idle(mesh, servable) else None

    wait_until("the servable idle, in a later heartbeat", settled, 30.0)
    return int(mesh.ranks(servable)[0]["jobs_done"])


@pytest.mark.parametrize("servable", SERVABLES)
async def test_greedy_text_with_decode_runs_equals_transformers(
    mesh: LocalMesh, servable: str
) -> None:
    for prompt in PROMPTS:
        before = await asyncio.to_thread(steps_done, mesh, servable)
        n = len(prompt["greedy_ids"])
        text = await complete(mesh, servable, prompt["text"], n, temperature=0.0)
        assert text == prompt["greedy_text"]
        steps = await asyncio.to_thread(steps_done, mesh, servable) - before
        # a prefill, one timed decode step, then runs of 8 (capped by the tokens left)
        assert steps <= 2 + -(-(n - 2) // 8), f"{steps} steps for {n} tokens: no runs?"


@pytest.mark.parametrize("servable", SERVABLES)
async def test_seeded_sampling_equals_one_step_per_stepwork(
    mesh: LocalMesh, servable: str, single_step_texts: Texts
) -> None:
    texts = await seeded_texts(mesh)
    for i in range(len(PROMPTS)):
        assert texts[(servable, i)] == single_step_texts[(servable, i)]
        assert texts[(servable, i)], "an empty text proves nothing"


@pytest.mark.parametrize("servable", SERVABLES)
async def test_4_concurrent_sequences_of_different_lengths_each_give_their_alone_text(
    mesh: LocalMesh, servable: str
) -> None:
    jobs = [(PROMPTS[i % 3]["text"][: 12 + 7 * i], 5 + 9 * i) for i in range(4)]
    alone = [await complete(mesh, servable, p, n, temperature=0.0) for p, n in jobs]
    together = await asyncio.gather(
        *(complete(mesh, servable, p, n, temperature=0.0) for p, n in jobs)
    )
    assert together == alone
    seeded_alone = [await complete(mesh, servable, p, n, **SEEDED) for p, n in jobs]
    seeded_together = await asyncio.gather(
        *(complete(mesh, servable, p, n, **SEEDED) for p, n in jobs)
    )
    assert seeded_together == seeded_alone
