"""`shardserve up --threads 1|2|auto` at TP 1 and TP 2: every agent gets the count the rule
of `shardserve.process.cores` gives on this machine, and the text is transformers' greedy
text whatever the count (onnxruntime splits a MatMul differently over 2 threads; batched
sequences too). The `openai` package on /v1/completions of a real mesh."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shardserve.ops.child_mesh import LocalMesh, cmdline
from shardserve.process.cores import parse_threads, threads_per_agent, usable_cores
from shardserve.tools.export.hf import export_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import FIXTURE, REFERENCE, start_mesh

pytestmark = pytest.mark.integration

PROMPTS: list[dict[str, Any]] = REFERENCE["prompts"]
SERVABLE = "llama"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(
    scope="module",
    params=[(ranks, threads) for ranks in (1, 2) for threads in ("1", "2", "auto")],
    ids=lambda p: f"tp{p[0]}-threads-{p[1]}",
)
def mesh(
    request: pytest.FixtureRequest,
    isolated_amqp_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalMesh, int]]:
    """A mesh of the llama fixture at TP ``ranks`` with ``--threads``; and the thread count
    each of its agents must get here."""
    ranks, threads = request.param
    repo = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=ranks, name=SERVABLE)
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = start_mesh(repo, isolated_amqp_url, log, ("--threads", threads))
    try:
        yield mesh, threads_per_agent(ranks, usable_cores(), parse_threads(threads))
    finally:
        mesh.stop()


def test_every_agent_runs_the_thread_count_of_the_rule(mesh: tuple[LocalMesh, int]) -> None:
    running, expected = mesh
    counts = []
    for pid in running.service_pids("agent"):
        argv = cmdline(pid)
        counts.append(int(argv[argv.index("--threads") + 1]))
    assert counts and counts == [expected] * len(counts)
    assert f"with {expected} onnxruntime thread(s) each" in running.log_tail(400)


async def test_greedy_text_is_transformers_alone_and_batched(
    mesh: tuple[LocalMesh, int],
) -> None:
    running, _ = mesh
    client = openai.AsyncOpenAI(base_url=running.http_url + "/v1", api_key="-", max_retries=0)
    async with client:

        async def greedy(prompt: dict[str, Any]) -> str:
            done = await client.completions.create(
                model=SERVABLE,
                prompt=prompt["text"],
                max_tokens=len(prompt["greedy_ids"]),
                temperature=0.0,
                extra_body=IGNORE_EOS,
            )
            return done.choices[0].text

        alone = [await greedy(prompt) for prompt in PROMPTS]
        batched = await asyncio.gather(*(greedy(prompt) for prompt in PROMPTS))
    assert alone == [prompt["greedy_text"] for prompt in PROMPTS]
    assert batched == alone
