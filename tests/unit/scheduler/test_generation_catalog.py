"""The catalog reads a text-generation servable from both marks `shardserve export hf`
writes (servable_config.py's ``generation=True``, group.json's origin task) and refuses a
version whose two marks disagree, naming both."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from test_generation_kit import FIXTURE

from shardserve.repo.repository import write_group
from shardserve.tools.export.hf import export_hf
from shardserve_scheduler.core.catalog import VersionEntry, load_catalog

OLD_EXPORTER_CONFIG = """
from shardserve.servable import add_stage, declare_servable, register_method

model = declare_servable(rank_size=2, stage_size=1, with_batch_dim=False)


@register_method(output_names=["logits"])
def predict(input_ids, positions, logit_rows):
    logits = add_stage(model, input_ids, positions, logit_rows, outputs_count=1)
    return logits
"""

GENERATION_CONFIG = """
from shardserve.servable import declare_servable

model = declare_servable(rank_size=2, stage_size=1, generation=True)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exported")
    export_hf(FIXTURE, out, rank_size=2, name="llama")
    return out


@pytest.fixture
def repo(exported: Path, tmp_path: Path) -> Path:
    shutil.copytree(exported, tmp_path, dirs_exist_ok=True)
    return tmp_path


def llama(repo: Path) -> VersionEntry:
    entry = load_catalog(repo).entry(("llama", 1))
    assert entry is not None
    return entry


def test_the_exported_config_declares_generation_and_is_served_as_such(repo: Path) -> None:
    text = (repo / "llama" / "servable_config.py").read_text()
    assert "declare_servable(rank_size=2, stage_size=1, generation=True)" in text
    assert "register_method" not in text
    entry = llama(repo)
    assert entry.generation and not entry.problem
    assert entry.methods == {} and entry.unsupported == {}


def test_a_generation_version_without_a_config_is_still_generation(repo: Path) -> None:
    (repo / "llama" / "servable_config.py").unlink()
    entry = llama(repo)
    assert entry.generation and not entry.problem and entry.methods == {}


def test_a_method_config_on_a_generation_group_is_refused(repo: Path) -> None:
    (repo / "llama" / "servable_config.py").write_text(OLD_EXPORTER_CONFIG)
    entry = llama(repo)
    assert entry.methods == {}
    assert "declares a servable with methods" in entry.problem
    assert "group.json of llama v1 marks a text-generation servable" in entry.problem
    assert "generation=True" in entry.problem


def test_a_generation_config_on_a_method_group_is_refused(kit: Any, tmp_path: Path) -> None:
    folder = tmp_path / "matmul" / "1"
    folder.mkdir(parents=True)
    write_group(folder, kit.group(servable="matmul", version=1))
    (tmp_path / "matmul" / "servable_config.py").write_text(GENERATION_CONFIG)
    entry = load_catalog(tmp_path).entry(("matmul", 1))
    assert entry is not None and not entry.generation and entry.methods == {}
    assert "declares a text-generation servable (generation=True)" in entry.problem
    assert 'group.json of matmul v1 has no origin task, not "text-generation"' in entry.problem


def test_method_servables_are_unchanged(kit: Any, tmp_path: Path) -> None:
    folder = tmp_path / "matmul" / "1"
    folder.mkdir(parents=True)
    write_group(folder, kit.group(servable="matmul", version=1))
    entry = load_catalog(tmp_path).entry(("matmul", 1))
    assert entry is not None and not entry.generation and list(entry.methods) == ["predict"]
