"""A GenerateRequest resolved against a real exported repository: the generation marker the
exporter writes, prompt / chat / ids tokenized with the version's tokenizer, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_generation_kit import FIXTURE

from shardserve.errors import BadInputError, NotFoundError, UnavailableError
from shardserve.tools.export.hf import export_hf
from shardserve.wire.protocol import AgentHeartbeat, AgentHello, ChatMessage, GenerateRequest
from shardserve_scheduler.core.catalog import Catalog, load_catalog
from shardserve_scheduler.core.generation.resolve import resolve_generation
from shardserve_scheduler.core.generation.texts import TextModels
from shardserve_scheduler.core.registry import Registry

REFERENCE = json.loads((FIXTURE / "reference.json").read_text())


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, out, rank_size=1, name="llama")
    return out


def ready_registry(catalog: Catalog) -> Registry:
    registry = Registry.build(catalog.groups(), 0.0)
    for group in catalog.groups():
        for spec in group.ranks:
            fields = dict(
                instance=f"{group.servable}-{spec.rank}",
                servable=group.servable,
                version=group.version,
                rank=spec.rank,
                stage=spec.stage,
                slice_checksum=spec.checksum,
            )
            assert registry.hello(AgentHello(**fields), 0.0).accepted
            assert registry.heartbeat(AgentHeartbeat(**fields), 0.0)
    return registry


def generate(**kw: object) -> GenerateRequest:
    return GenerateRequest(id="r", servable="llama", deadline=100.0, **kw)


def test_the_exporter_marks_the_version_as_generation(repo: Path) -> None:
    catalog = load_catalog(repo)
    entry = catalog.entry(("llama", 1))
    assert entry is not None and entry.generation


def test_prompt_text_chat_and_ids(repo: Path) -> None:
    catalog = load_catalog(repo)
    registry = ready_registry(catalog)
    texts = TextModels(repo)
    prompt = REFERENCE["prompts"][0]
    target = resolve_generation(catalog, registry, texts, generate(prompt=prompt["text"]))
    assert list(target.prompt) == prompt["input_ids"]
    assert target.max_positions == 128
    chat = REFERENCE["chat"]
    messages = tuple(ChatMessage(**m) for m in chat["messages"])
    target = resolve_generation(catalog, registry, texts, generate(messages=messages))
    assert target.text.decode(target.prompt, skip_special_tokens=False) == chat["text"]
    target = resolve_generation(catalog, registry, texts, generate(prompt_ids=(0, 5)))
    assert target.prompt == (0, 5)
    assert texts(target.group) is target.text  # loaded once per version


def test_refusals(repo: Path) -> None:
    catalog = load_catalog(repo)
    texts = TextModels(repo)
    with pytest.raises(UnavailableError, match="not ready"):
        resolve_generation(
            catalog, Registry.build(catalog.groups(), 0.0), texts, generate(prompt="x")
        )
    registry = ready_registry(catalog)
    with pytest.raises(BadInputError, match="outside the vocabulary"):
        resolve_generation(catalog, registry, texts, generate(prompt_ids=(0, 512)))
    missing = GenerateRequest(id="r", servable="nope", prompt="x", deadline=1.0)
    with pytest.raises(NotFoundError, match="servables: llama"):
        resolve_generation(catalog, registry, texts, missing)


def test_a_servable_without_the_marker_is_refused(repo: Path, tmp_path: Path) -> None:
    group_file = repo / "llama" / "1" / "group.json"
    data = json.loads(group_file.read_text())
    del data["origin"]["task"]
    copy = tmp_path / "llama" / "1"
    copy.mkdir(parents=True)
    (copy / "group.json").write_text(json.dumps(data))
    catalog = load_catalog(tmp_path)
    with pytest.raises(BadInputError, match="not a text-generation servable"):
        resolve_generation(
            catalog, ready_registry(catalog), TextModels(tmp_path), generate(prompt="x")
        )
