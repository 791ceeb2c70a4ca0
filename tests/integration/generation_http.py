"""What the HTTP generation tests share: a mesh of exported llama fixtures started with
`shardserve up`, server-sent events read off a raw HTTP response, and the KV use and
sequence counts the status page reports.

Imported by test_generation_http.py and test_generation_faults.py (their folder is put on
sys.path by them: pytest runs with --import-mode=importlib).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shardserve.ops.child_mesh import LocalMesh, free_port
from shardserve.tools.export.hf import export_hf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"
REFERENCE: dict[str, Any] = json.loads((FIXTURE / "reference.json").read_text())
DATA_PREFIX = b"data: "

# KV use and sequence counts show in the status within a few tenths of a second.
FAST_STATUS_ENV = {
    "SHARDSERVE_AGENT_HEARTBEAT_INTERVAL": "0.2",
    "SHARDSERVE_SCHEDULER_STATUS_INTERVAL": "0.2",
}


def start_mesh(
    repo: Path,
    amqp_url: str,
    log: Path,
    up_args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    grpc_port: int = 0,
) -> LocalMesh:
    """`shardserve up REPO` with the fast status (and gRPC on ``grpc_port`` unless 0),
    ready; stopped by the caller."""
    mesh = LocalMesh(
        repo, amqp_url, free_port(), log, up_args, {**FAST_STATUS_ENV, **(env or {})}, grpc_port
    )
    mesh.start()
    try:
        mesh.wait_ready()
    except BaseException:
        mesh.stop()
        raise
    return mesh


@contextlib.contextmanager
def fixture_mesh(
    amqp_url: str, tmp: pytest.TempPathFactory, name: str, rank_size: int = 1
) -> Iterator[LocalMesh]:
    """The llama fixture exported at TP ``rank_size`` as ``name``, served by one
    `shardserve up` with gRPC on a free port."""
    repo = tmp.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=rank_size, name=name)
    mesh = start_mesh(repo, amqp_url, tmp.mktemp("mesh") / "mesh.log", grpc_port=free_port())
    try:
        yield mesh
    finally:
        mesh.stop()


@contextlib.contextmanager
def layouts_mesh(
    amqp_url: str, tmp: pytest.TempPathFactory, env: Mapping[str, str] | None = None
) -> Iterator[LocalMesh]:
    """The llama fixture exported at TP 2 (``llama_tp2``) and at 2 stages x TP 2
    (``llama_pp2``), served by one `shardserve up`."""
    repo = tmp.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=2, name="llama_tp2")
    export_hf(FIXTURE, repo, rank_size=4, stage_size=2, name="llama_pp2")
    mesh = start_mesh(repo, amqp_url, tmp.mktemp("mesh") / "mesh.log", env=env)
    try:
        yield mesh
    finally:
        mesh.stop()


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | str]:
    """The payloads of a stream's ``data:`` lines: JSON objects, or the raw text
    (``[DONE]``) of a line that is not JSON."""
    async for line in response.content:
        if not line.startswith(DATA_PREFIX):
            continue
        payload = line[len(DATA_PREFIX) :].strip()
        try:
            yield json.loads(payload)
        except ValueError:
            yield payload.decode()


async def read_sse(response: aiohttp.ClientResponse) -> list[dict[str, Any] | str]:
    return [event async for event in sse_events(response)]


async def streamed_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[tuple[str, float]]:
    """Each text event of a streamed ``/v1/completions`` answer with its arrival time; an
    error event or a status other than 200 fails the test."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            if isinstance(event, dict):
                assert "error" not in event, event
                yield "".join(choice["text"] for choice in event["choices"]), time.monotonic()


def servable_status(mesh: LocalMesh, servable: str) -> dict[str, Any]:
    for entry in mesh.status().get("servables", ()):
        if entry.get("name") == servable:
            return dict(entry)
    return {}


def kv_used(mesh: LocalMesh, servable: str) -> list[int]:
    """Every rank's KV bytes in use (an empty list when no rank reports)."""
    return [int(rank.get("kv_used_bytes", 0)) for rank in mesh.ranks(servable)]


def idle(mesh: LocalMesh, servable: str) -> bool:
    """No sequence running or waiting, and no KV in use on any rank."""
    entry = servable_status(mesh, servable)
    used = kv_used(mesh, servable)
    quiet = entry.get("running_sequences", 0) == 0 and entry.get("waiting_sequences", 0) == 0
    return quiet and bool(used) and not any(used)


def wait_for(condition: Callable[[], bool], seconds: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# --- a larger Llama-shaped checkpoint (numpy + safetensors) ------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_llama_checkpoint(
    folder: Path, *, hidden: int, layers: int, intermediate: int, kv_heads: int, max_positions: int
) -> dict[str, Any]:
    """A random Llama of the fixture's vocabulary and tokenizer, ``hidden`` wide with
    64-wide heads; returns its config."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    heads = hidden // 64
    config = json.loads((FIXTURE / "config.json").read_text())
    config |= {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 64,
        "max_position_embeddings": max_positions,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy(FIXTURE / name, folder / name)
    shapes = _llama_shapes(config)
    # Every tensor a window of one random pool at a random offset: drawing hundreds of
    # millions of normals takes longer than the rest of the test on a busy machine.
    rng = np.random.default_rng(0)
    largest = max(int(np.prod(shape)) for shape in shapes.values())
    pool = rng.standard_normal(2 * largest, dtype=np.float32) * np.float32(0.05)
    weights = {}
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, np.float32)
        else:
            start = int(rng.integers(0, len(pool) - size + 1))
            weights[name] = pool[start : start + size].reshape(shape)
    save_file(weights, str(folder / "model.safetensors"))
    return config


def _llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (q, hidden),
            layer + "self_attn.k_proj.weight": (kv, hidden),
            layer + "self_attn.v_proj.weight": (kv, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes
