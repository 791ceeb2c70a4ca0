"""Issue 36: one sequence's failure ends that sequence only, when the model's own numerics
fail it. The llama fixture with one embedding row made NaN (token ``POISON``, which no
reference prompt or answer holds), exported at TP 2 and served by `shardserve up`: a prompt
holding that token has NaN logits, the others are untouched (rows never mix in the model).
While the reference prompts stream, a poisoned prompt joins their steps; it alone ends with
an error naming the non-finite logits, and the streams complete with transformers' text
(before: the step failed and every sequence batched with it ended with the internal error).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from shardserve.ops.child_mesh import LocalMesh
from shardserve.tools.export.hf import export_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import FIXTURE, REFERENCE, start_mesh, streamed_completion

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

SERVABLE = "llama_nan"
EMBEDDING = "model.embed_tokens.weight"
PROMPTS = REFERENCE["prompts"]
USED = {t for p in PROMPTS for t in (*p["input_ids"], *p["greedy_ids"])}
POISON = min(set(range(2, 512)) - USED)
# One token per StepWork: the reference streams take a step per token, so the poisoned
# prompt surely shares steps with them (a decode run of 8 could end them before it joins).
ONE_STEP_PER_TOKEN = {"SHARDSERVE_SCHEDULER_MAX_DECODE_STEPS": "1"}


def poisoned_fixture(folder: Path) -> Path:
    """A copy of the llama fixture whose embedding row ``POISON`` is NaN."""
    shutil.copytree(FIXTURE, folder, dirs_exist_ok=True)
    for path in folder.glob("model-*.safetensors"):
        tensors = load_file(path)
        if EMBEDDING in tensors:
            tensors[EMBEDDING] = tensors[EMBEDDING].copy()
            tensors[EMBEDDING][POISON] = np.nan
            save_file(tensors, path, metadata={"format": "pt"})
            return folder
    raise AssertionError(f"no {EMBEDDING} in the llama fixture")


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    checkpoint = poisoned_fixture(tmp_path_factory.mktemp("llama-nan"))
    repo = tmp_path_factory.mktemp("repo")
    export_hf(checkpoint, repo, rank_size=2, name=SERVABLE)
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = start_mesh(repo, isolated_amqp_url, log, env=ONE_STEP_PER_TOKEN)
    try:
        yield mesh
    finally:
        mesh.stop()


def greedy(prompt: Any, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": SERVABLE,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


async def reference_stream(
    session: aiohttp.ClientSession, base: str, prompt: dict[str, Any], started: asyncio.Event
) -> str:
    """The streamed text; ``started`` is set at its first token."""
    parts: list[str] = []
    body = greedy(prompt["text"], len(prompt["greedy_ids"]), stream=True)
    async for text, _ in streamed_completion(session, base + "/v1/completions", body):
        parts.append(text)
        started.set()
    return "".join(parts)


async def test_a_non_finite_logit_row_ends_its_sequence_alone(mesh: LocalMesh) -> None:
    base = mesh.http_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        started = [asyncio.Event() for _ in PROMPTS]
        streams = [
            asyncio.ensure_future(reference_stream(session, base, p, s))
            for p, s in zip(PROMPTS, started, strict=True)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            poisoned = greedy([0, 5, POISON, 6, 7], 8, stream=False)
            async with session.post(base + "/v1/completions", json=poisoned) as resp:
                status, answer = resp.status, await resp.json()
            running_then = [not s.done() for s in streams]
            texts = await asyncio.gather(*streams)
        finally:
            for task in streams:
                task.cancel()
    assert status == 500
    assert "not finite" in answer["error"]["message"], answer
    assert texts == [p["greedy_text"] for p in PROMPTS]
    # The poisoned sequence ended while the streams ran: it shared their steps (one lane).
    assert all(running_then)
    assert "no heartbeat for" not in mesh.log_path.read_text(errors="replace")
