"""examples/generate_client.py (aio-pika + msgpack only) against a live mesh serving the
exported llama fixture at TP 2: it streams transformers' greedy text, cancels on request
(the KV cache is freed), and reports an error chunk with exit code 1."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest

from shardserve.ops.child_mesh import LocalMesh, free_port
from shardserve.tools.export.hf import export_hf
from shardserve.wire import codec
from shardserve.wire.protocol import GenerateCancel, GenerateRequest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "generate_client.py"
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
RUN_S = 120.0


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=2)  # servable "llama": the example's default
    env = {
        "SHARDSERVE_AGENT_HEARTBEAT_INTERVAL": "0.2",  # KV use shows in the status quickly
        "SHARDSERVE_SCHEDULER_STATUS_INTERVAL": "0.2",
    }
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = LocalMesh(repo, isolated_amqp_url, free_port(), log, (), env)
    mesh.start()
    try:
        mesh.wait_ready()
        yield mesh
    finally:
        mesh.stop()


def run_example(amqp_url: str, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr; bytes decoded as they are (the text may hold "\\r")."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--amqp-url", amqp_url, "--timeout", "60", *args],
        capture_output=True,
        timeout=RUN_S,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def example_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_client", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_example_messages_are_what_the_codec_reads() -> None:
    example = example_module()
    options = example.parse(["--prompt", "Hi", "--max-tokens", "5", "--seed", "3", "--ignore-eos"])
    body = msgpack.packb(example.generate_request(options, time.time() + 10), use_bin_type=True)
    request = codec.decode_as(body, GenerateRequest)
    assert request.servable == "llama" and request.prompt == "Hi" and request.version == 0
    assert request.sampling.max_tokens == 5 and request.sampling.temperature == 0.0
    assert request.sampling.seed == 3 and request.sampling.ignore_eos
    cancel = msgpack.packb(example.cancel_message("q", "c1"), use_bin_type=True)
    assert codec.decode_as(cancel, GenerateCancel) == GenerateCancel(
        reply_to="q", correlation_id="c1"
    )


def test_the_example_streams_transformers_greedy_text(mesh: Any) -> None:
    prompt = REFERENCE["prompts"][1]
    count = len(prompt["greedy_ids"])
    args = ("--prompt", prompt["text"], "--max-tokens", str(count), "--ignore-eos")
    code, out, err = run_example(mesh.amqp_url, *args)
    assert code == 0, err
    text, summary = out.rsplit("\n", 2)[:2]
    assert text == prompt["greedy_text"]
    expected = (
        rf"\[finish_reason=length prompt_tokens={len(prompt['input_ids'])} "
        rf"completion_tokens={count} chunks=\d+\]"
    )
    assert re.fullmatch(expected, summary), summary


def test_the_example_cancels_and_the_kv_cache_is_freed(mesh: Any) -> None:
    args = ("--max-tokens", "100", "--ignore-eos", "--cancel-after", "2")
    code, out, err = run_example(mesh.amqp_url, *args)
    assert code == 0, err
    # The cancel goes out after the second chunk; chunks already on their way arrive before
    # the stream's cancelled end (on a loaded machine, a few), never the whole generation.
    found = re.search(
        r"\[cancelled after (\d+) chunks: the generation was cancelled by its caller\]", out
    )
    assert found is not None, out
    assert 2 <= int(found.group(1)) < 100, out
    assert wait_for(lambda: kv_used(mesh) == 0, 15.0), "KV cache still in use after the cancel"


def test_an_error_chunk_exits_1_with_its_code(mesh: Any) -> None:
    code, _, err = run_example(mesh.amqp_url, "--servable", "nope")
    assert code == 1
    assert "error not_found: servable 'nope' not found; servables: llama" in err


def wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kv_used(mesh: Any) -> int:
    return sum(int(rank.get("kv_used_bytes", 0)) for rank in mesh.ranks("llama"))
