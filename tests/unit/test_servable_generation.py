"""servable_config.py of a text-generation servable: ``declare_servable(...,
generation=True)`` and no methods (what ``shardserve export hf`` writes); method configs
keep their rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.errors import ServableConfigError
from shardserve.servable import ServableDefinition, load_servable_config

GENERATION_CONFIG = """
from shardserve.servable import declare_servable

model = declare_servable(rank_size=2, stage_size=1, generation=True)
"""

METHOD_ON_GENERATION = """
from shardserve.servable import add_stage, declare_servable, register_method

model = declare_servable(rank_size=2, stage_size=1, generation=True)


@register_method(output_names=["logits"])
def predict(input_ids):
    return add_stage(model, input_ids, outputs_count=1)
"""

PYTHON_METHOD_THEN_GENERATION = """
from shardserve.servable import add_stage, declare_servable, register_method


@register_method(output_names=["y"])
def double(x):
    return add_stage(lambda v: v * 2, x, outputs_count=1)


model = declare_servable(rank_size=2, stage_size=1, generation=True)
"""


def load(tmp_path: Path, text: str) -> ServableDefinition:
    config = tmp_path / "servable_config.py"
    config.write_text(text)
    return load_servable_config(config)


def test_a_generation_servable_declares_itself_and_needs_no_method(tmp_path: Path) -> None:
    definition = load(tmp_path, GENERATION_CONFIG)
    assert definition.generation and definition.methods == {}
    assert definition.model is not None and definition.model.generation


def test_a_method_on_a_generation_servable_is_refused_at_its_line(tmp_path: Path) -> None:
    with pytest.raises(ServableConfigError) as info:
        load(tmp_path, METHOD_ON_GENERATION)
    message = str(info.value)
    assert "servable_config.py:7:" in message  # the decorator's line
    assert "registers no method (found: predict)" in message
    assert "/v1/completions" in message


def test_a_method_before_a_generation_declaration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServableConfigError, match="found: double"):
        load(tmp_path, PYTHON_METHOD_THEN_GENERATION)


def test_generation_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ServableConfigError, match="generation must be True or False, got 'yes'"):
        load(tmp_path, GENERATION_CONFIG.replace("generation=True", 'generation="yes"'))


def test_a_method_servable_without_methods_still_fails_and_says_how(tmp_path: Path) -> None:
    with pytest.raises(ServableConfigError, match="no method registered") as info:
        load(tmp_path, GENERATION_CONFIG.replace(", generation=True", ""))
    assert "generation=True" in str(info.value)


def test_method_servables_default_to_no_generation(tmp_path: Path) -> None:
    definition = load(tmp_path, METHOD_ON_GENERATION.replace(", generation=True", ""))
    assert not definition.generation
    assert list(definition.methods) == ["predict"]
