"""Generation on capped agents, and the KV budget's limits, through a real mesh.

A Llama-shaped checkpoint written here (numpy + safetensors) whose weights are larger than
one agent's memory cap (RLIMIT_DATA) is served at TP 4 by `shardserve up --max-memory-mb CAP
--kv-cache-mb 1`: its greedy tokens equal a numpy forward of the same weights. Exported
``--quantize int4``, the same checkpoint is served by 2 agents under a cap below even one
rank's fp32 share, its greedy tokens those of a numpy forward of the dequantized blocks.
The 1 MiB KV budget holds 64 tokens per rank, so a request that needs more gets 400 naming
the limit, one that cannot fit now waits, and one more than the waiting queue holds gets
503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import hf_checkpoints
import numpy as np
import pytest
from quantized_reference import dequantized_weights
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from shardserve.ops.child_mesh import LocalMesh, isolated_vhost
from shardserve.tools.export.hf import export_hf
from shardserve.tools.quantize import QuantizeSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import (
    FIXTURE,
    idle,
    read_sse,
    servable_status,
    start_mesh,
    wait_for,
    write_llama_checkpoint,
)

pytestmark = pytest.mark.integration

SERVABLE = "big"
RANKS = 4
# Half the weights' 790 MiB. Each agent's slice is 201 MiB on disk; under the cap (private
# writable memory, shardserve_agent.memory_cap) an agent holds 314 MiB once loaded and
# registered, 321 after its first steps: the slice and ~120 MiB of interpreter, libraries'
# data, one OpenBLAS buffer, thread stacks and buffers. At 310 MiB the load failed
# (bad_alloc, exit 1); at 320 and 330 agents loaded, served and stopped cleanly; 400 leaves
# ~80 MiB of margin. (Under RLIMIT_AS, before, the same agents served at 600-690 MiB; at
# 565-580 their first prefill failed with bad_alloc.)
CAP_MB = 400
KV_MB = 1
MAX_WAITING = 1
SHAPE = {"hidden": 2048, "layers": 4, "intermediate": 5632, "kv_heads": 32, "max_positions": 512}
# layers x (K, V) x 8 KV heads per rank x 64 x 4 bytes: 16 KiB a token, 64 tokens a rank.
KV_TOKENS = KV_MB * 2**20 // (SHAPE["layers"] * 2 * (32 // RANKS) * 64 * 4)
# int4 at TP 2: each rank's fp32 share would be 395 MiB; its int4 slice is ~60 MiB.
INT4_RANKS = 2
INT4_CAP_MB = 300
INT4 = QuantizeSpec("int4", 32, accuracy_level=0)  # fp32 activations: exact vs numpy
PROMPT_IDS = [0, 17, 42, 99, 7, 230]
NEW_TOKENS = 4
TOKENIZER = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    write_llama_checkpoint(folder, **SHAPE)
    return folder


@pytest.fixture(scope="module")
def expected_tokens(checkpoint: Path) -> Iterator[Future[list[int]]]:
    """The numpy greedy tokens, computed while the mesh starts."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(numpy_greedy, checkpoint, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def mesh(
    checkpoint: Path, isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    repo = tmp_path_factory.mktemp("repo")
    export_hf(checkpoint, repo, rank_size=RANKS, name=SERVABLE)
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    up_args = ("--max-memory-mb", str(CAP_MB), "--kv-cache-mb", str(KV_MB), "--no-cache")
    env = {"SHARDSERVE_SCHEDULER_MAX_WAITING_SEQUENCES": str(MAX_WAITING)}
    mesh = start_mesh(repo, isolated_amqp_url, log, up_args, env)
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def int4_mesh(
    checkpoint: Path, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    # A vhost of its own: `shardserve up` refuses a second mesh on a vhost that already has
    # one, and the module's fp32 mesh may still be running.
    repo = tmp_path_factory.mktemp("repo_int4")
    export_hf(checkpoint, repo, rank_size=INT4_RANKS, name=SERVABLE, quantize=INT4)
    log = tmp_path_factory.mktemp("mesh_int4") / "mesh.log"
    up_args = ("--max-memory-mb", str(INT4_CAP_MB), "--kv-cache-mb", str(KV_MB), "--no-cache")
    with isolated_vhost(amqp_url, "shardserve-test") as url:
        mesh = start_mesh(repo, url, log, up_args)
        try:
            yield mesh
        finally:
            mesh.stop()


def numpy_greedy(
    checkpoint: Path, ids: list[int], new_tokens: int, quantize: QuantizeSpec | None = None
) -> list[int]:
    """Greedy tokens of a numpy forward of the checkpoint (no cache); with ``quantize``,
    of its linear layers' dequantized blocks."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    hf_checkpoints.CONFIGS["capped_llama"] = config
    # float32, as served: a float64 copy of these weights costs more time than it buys.
    weights = load_file(checkpoint / "model.safetensors")
    head = hf_checkpoints.default_head("capped_llama", weights)
    if quantize is not None:
        weights, head = dequantized_weights(
            "capped_llama", weights, quantize.bits, quantize.block_size
        )
    ids = list(ids)
    for _ in range(new_tokens):
        logits = hf_checkpoints._llama("capped_llama", weights, ids) @ head.T
        ids.append(int(np.argmax(logits[-1])))
    return ids[-new_tokens:]


def status_mb(pid: int, field: str) -> float:
    """A ``Vm...:  123 kB`` field of /proc/PID/status, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def limit_mb(pid: int, name: str) -> float:
    """The soft limit ``name`` (e.g. "Max data size") of a process in MiB (inf: unlimited)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            soft = line[len(name) :].split()[0]
            return float("inf") if soft == "unlimited" else int(soft) / 2**20
    raise AssertionError(f"no {name!r} limit line for {pid}")


async def completion(
    session: aiohttp.ClientSession,
    mesh: LocalMesh,
    max_tokens: int,
    prompt: list[int] = PROMPT_IDS,
    **extra: Any,
) -> aiohttp.ClientResponse:
    body = {
        "model": SERVABLE,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return await session.post(mesh.http_url + "/v1/completions", json=body | extra)


async def test_weights_larger_than_one_agents_cap_generate_across_capped_agents(
    expected_tokens: Future[list[int]], mesh: LocalMesh, checkpoint: Path
) -> None:
    weights_mb = (checkpoint / "model.safetensors").stat().st_size / 2**20
    assert weights_mb > CAP_MB, "the checkpoint would fit one capped agent"
    new_tokens = NEW_TOKENS
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        response = await completion(session, mesh, new_tokens)
        assert response.status == 200, await response.text()
        body = await response.json()
    took = time.monotonic() - started
    expected = await asyncio.wrap_future(expected_tokens)
    assert body["usage"]["completion_tokens"] == new_tokens
    assert body["choices"][0]["text"] == TOKENIZER.decode(expected, skip_special_tokens=True)
    agents = mesh.service_pids("agent")
    assert [limit_mb(pid, "Max data size") for pid in agents] == [CAP_MB] * RANKS
    # The address space is left alone: code and reservations are not what the cap means.
    assert [limit_mb(pid, "Max address space") for pid in agents] == [float("inf")] * RANKS
    data = [status_mb(pid, "VmData") for pid in agents]
    address = [status_mb(pid, "VmPeak") for pid in agents]
    print(
        f"weights {weights_mb:.0f} MiB, cap {CAP_MB} MiB, agents' data {max(data):.0f} MiB "
        f"(address space peak {max(address):.0f} MiB), {new_tokens} tokens in {took:.2f} s"
    )


@pytest.mark.heavy  # quantizing 790 MiB twice (export, numpy reference) on 2 cores
async def test_int4_slices_generate_on_agents_capped_below_a_ranks_fp32_share(
    int4_mesh: LocalMesh, checkpoint: Path
) -> None:
    expected = await asyncio.to_thread(numpy_greedy, checkpoint, PROMPT_IDS, NEW_TOKENS, INT4)
    weights_mb = (checkpoint / "model.safetensors").stat().st_size / 2**20
    assert weights_mb / INT4_RANKS > INT4_CAP_MB, "an fp32 rank would fit the cap"
    async with aiohttp.ClientSession() as session:
        response = await completion(session, int4_mesh, NEW_TOKENS)
        assert response.status == 200, await response.text()
        body = await response.json()
    assert body["choices"][0]["text"] == TOKENIZER.decode(expected, skip_special_tokens=True)
    agents = int4_mesh.service_pids("agent")
    assert [limit_mb(pid, "Max data size") for pid in agents] == [INT4_CAP_MB] * INT4_RANKS
    data = [status_mb(pid, "VmData") for pid in agents]
    print(f"int4: weights {weights_mb:.0f} MiB fp32, cap {INT4_CAP_MB} MiB, data {max(data):.0f}")


async def test_a_request_that_can_never_fit_gets_400_naming_the_limit(mesh: LocalMesh) -> None:
    async with aiohttp.ClientSession() as session:
        response = await completion(session, mesh, KV_TOKENS, stream=True)
        assert response.status == 400, await response.text()
        error = (await response.json())["error"]
    assert error["code"] == "bad_input"
    assert f"needs {len(PROMPT_IDS) + KV_TOKENS} tokens of KV cache" in error["message"], error
    assert f"holds at most {KV_TOKENS} tokens of KV cache" in error["message"], error


async def test_one_that_cannot_fit_now_waits_and_a_full_queue_gets_503(mesh: LocalMesh) -> None:
    # Short prompts, many new tokens: each of the two running sequences takes dozens of
    # decode steps (seconds), a wide window for the third to be seen waiting.
    prompt = PROMPT_IDS
    half = KV_TOKENS // 2 - len(prompt)  # two of these fill every rank's budget
    async with aiohttp.ClientSession() as session:
        running = [await completion(session, mesh, half, prompt, stream=True) for _ in range(2)]
        assert [r.status for r in running] == [200, 200]
        waiting = asyncio.create_task(read_whole(session, mesh, half, prompt))
        queued = await asyncio.to_thread(
            wait_for, lambda: servable_status(mesh, SERVABLE).get("waiting_sequences") == 1, 5.0
        )
        refused = await completion(session, mesh, half, prompt)
        refused_body = await refused.json()
        for response in running:
            events = await read_sse(response)
            assert events[-1] == "[DONE]", events[-2:]
        waited = await asyncio.wait_for(waiting, 60.0)
    assert queued, "the third request was not waiting"
    assert refused.status == 503, refused_body
    assert refused.headers.get("Retry-After"), dict(refused.headers)
    assert refused_body["error"]["code"] == "overloaded"
    assert waited["usage"]["completion_tokens"] == half
    assert await asyncio.to_thread(wait_for, lambda: idle(mesh, SERVABLE), 10.0)


async def read_whole(
    session: aiohttp.ClientSession, mesh: LocalMesh, max_tokens: int, prompt: list[int]
) -> Any:
    response = await completion(session, mesh, max_tokens, prompt)
    assert response.status == 200, await response.text()
    return await response.json()
