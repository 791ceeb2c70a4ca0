"""Quantized slices through a real mesh (`shardserve up`, real RabbitMQ, one process per
rank): the llama fixture exported with ``--quantize`` at TP 2 and at 2 stages x TP 2 gives
the greedy text of the same quantized model run unsliced in this process (onnxruntime,
one rank). Blocks of 16 divide every rank's share of K, so a rank holds exactly the
unsliced model's blocks; accuracy_level 0 (fp32 activations) and 4 (int8 activations per
block, as each rank quantizes the same blocks of its activations) both agree token for
token."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from hf_runner import PackedModel
from tokenizers import Tokenizer

from shardserve.ops.child_mesh import LocalMesh
from shardserve.tools.export.hf import export_hf
from shardserve.tools.quantize import QuantizeSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import FIXTURE, start_mesh

pytestmark = pytest.mark.integration

BLOCK = 16
# servable -> (precision, accuracy_level, ranks, stages)
SERVABLES = {
    "q4_tp2": ("int4", 0, 2, 1),
    "q8_pp2": ("int8", 0, 4, 2),
    "q4fast_pp2": ("int4", 4, 4, 2),
}
PROMPTS = ([1, 415, 29, 90, 285, 114], [1, 306, 76, 263, 78, 17, 42, 99])
NEW_TOKENS = 16
TOKENIZER = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


def spec(servable: str) -> QuantizeSpec:
    precision, level, _, _ = SERVABLES[servable]
    return QuantizeSpec(precision, BLOCK, level)


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    repo = tmp_path_factory.mktemp("repo")
    for name, (_, _, ranks, stages) in SERVABLES.items():
        export_hf(FIXTURE, repo, rank_size=ranks, stage_size=stages, name=name, quantize=spec(name))
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = start_mesh(repo, isolated_amqp_url, log)
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def unsliced_texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each servable's quantization exported for one rank and run in this process: the
    greedy text of each prompt."""
    repo = tmp_path_factory.mktemp("unsliced")
    texts = {}
    for name in SERVABLES:
        export_hf(FIXTURE, repo, rank_size=1, name=name, quantize=spec(name))
        model = PackedModel(repo, name)
        texts[name] = [greedy_text(model, seq, prompt) for seq, prompt in enumerate(PROMPTS, 1)]
    return texts


def greedy_text(model: PackedModel, seq_id: int, prompt: list[int]) -> str:
    tokens, _ = model.generate(seq_id, prompt, NEW_TOKENS)
    return TOKENIZER.decode(tokens, skip_special_tokens=True)


async def served_text(
    session: aiohttp.ClientSession, mesh: LocalMesh, servable: str, prompt: list[int]
) -> str:
    body = {
        "model": servable,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = await session.post(mesh.http_url + "/v1/completions", json=body)
    assert response.status == 200, await response.text()
    answer = await response.json()
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    return str(answer["choices"][0]["text"])


@pytest.mark.parametrize("servable", sorted(SERVABLES))
async def test_the_sliced_quantized_mesh_gives_the_unsliced_quantized_text(
    servable: str, mesh: LocalMesh, unsliced_texts: dict[str, list[str]]
) -> None:
    async with aiohttp.ClientSession() as session:
        served = [await served_text(session, mesh, servable, prompt) for prompt in PROMPTS]
    assert served == unsliced_texts[servable]
