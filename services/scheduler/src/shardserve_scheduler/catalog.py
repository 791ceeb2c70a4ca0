"""What the repository offers: servables, their versions (group.json) and their methods.

Each servable's ``servable_config.py`` is loaded in isolation: a broken one makes that
servable unavailable (its ``problem`` is the "<file>:<line>: <problem>" message) and
touches no other servable. A servable without a config gets one method, ``predict`` = the
model, with the group's inputs and outputs.

A method maps its own input/output names onto the model's by position, as MindSpore's
``add_stage(model, x, ...)`` does. Only methods whose one stage is the model are served;
Python pre/post-processing stages are refused at load time with a reason (see README).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.errors import RepositoryError, ServableConfigError
from shardserve.protocol import TensorMap, TensorSpec
from shardserve.repository import (
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    list_versions,
    load_group,
)
from shardserve.servable import (
    MethodDefinition,
    ServableDefinition,
    load_servable_config,
)

_logger = logging.getLogger(__name__)

DEFAULT_METHOD = "predict"


@dataclass(frozen=True)
class MethodPlan:
    """A servable method that runs the model once: its signature and the name mapping."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # (model input name, method input name), in model order
    input_map: tuple[tuple[str, str], ...]
    # (method output name, model output name), in method order
    output_map: tuple[tuple[str, str], ...]

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    def model_inputs(self, instance: Mapping[str, object]) -> TensorMap:
        """The model's input tensors for one (validated) instance of this method."""
        return {model: instance[method] for model, method in self.input_map}  # type: ignore[misc]

    def method_outputs(self, model_outputs: TensorMap, wanted: tuple[str, ...] | None) -> TensorMap:
        """Rename model outputs to the method's names, keeping only ``wanted`` if given."""
        keep = set(wanted) if wanted else None
        return {
            method: model_outputs[model]
            for method, model in self.output_map
            if keep is None or method in keep
        }


@dataclass(frozen=True)
class VersionEntry:
    """One version of a servable: its group, its usable methods, and why others are not."""

    group: GroupConfig
    methods: dict[str, MethodPlan] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    problem: str = ""


@dataclass(frozen=True)
class ServableEntry:
    name: str
    versions: dict[int, VersionEntry] = field(default_factory=dict)
    broken_versions: dict[int, str] = field(default_factory=dict)
    problem: str = ""

    def all_versions(self) -> list[int]:
        return sorted(set(self.versions) | set(self.broken_versions))


@dataclass(frozen=True)
class Catalog:
    servables: dict[str, ServableEntry]

    def groups(self) -> list[GroupConfig]:
        """Every loadable group (servable, version) of the repository."""
        return [v.group for s in self.servables.values() for v in s.versions.values()]


def load_catalog(repo: Path) -> Catalog:
    """Read every servable of the repository; problems are logged at ERROR, never raised."""
    if not repo.is_dir():
        raise RepositoryError(f"model repository {repo} does not exist")
    servables: dict[str, ServableEntry] = {}
    for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = list_versions(repo, folder.name)
        if versions:
            servables[folder.name] = load_servable(repo, folder.name, versions)
    return Catalog(servables)


def load_servable(repo: Path, name: str, versions: list[int]) -> ServableEntry:
    definition, problem = _load_definition(repo / name / SERVABLE_CONFIG_FILE)
    if problem:
        _logger.error("servable %s is unavailable: %s", name, problem)
    loaded: dict[int, VersionEntry] = {}
    broken: dict[int, str] = {}
    for version in versions:
        try:
            group = load_group(repo, name, version)
        except RepositoryError as exc:
            _logger.error("servable %s version %d is unavailable: %s", name, version, exc)
            broken[version] = str(exc)
            continue
        if problem:  # listed (so status shows why), but serves nothing
            loaded[version] = VersionEntry(group, problem=problem)
        else:
            loaded[version] = build_version(group, definition)
    return ServableEntry(name, loaded, broken, problem)


def _load_definition(path: Path) -> tuple[ServableDefinition | None, str]:
    if not path.is_file():
        return None, ""
    try:
        return load_servable_config(path), ""
    except ServableConfigError as exc:
        return None, str(exc)


def build_version(group: GroupConfig, definition: ServableDefinition | None) -> VersionEntry:
    """The methods of one version: the default ``predict``, or the config's methods."""
    if definition is None:
        return VersionEntry(group, {DEFAULT_METHOD: default_method(group)})
    problem = _model_mismatch(group, definition)
    if problem:
        _logger.error("%s", problem)
        return VersionEntry(group, problem=problem)
    methods: dict[str, MethodPlan] = {}
    unsupported: dict[str, str] = {}
    for name, method in definition.methods.items():
        try:
            methods[name] = plan_method(group, method)
        except ValueError as exc:
            unsupported[name] = str(exc)
            _logger.error(
                "%s: method %r of %s v%d is unavailable: %s",
                definition.path,
                name,
                group.servable,
                group.version,
                exc,
            )
    return VersionEntry(group, methods, unsupported)


def default_method(group: GroupConfig) -> MethodPlan:
    return MethodPlan(
        DEFAULT_METHOD,
        group.inputs,
        group.outputs,
        tuple((s.name, s.name) for s in group.inputs),
        tuple((s.name, s.name) for s in group.outputs),
    )


def _model_mismatch(group: GroupConfig, definition: ServableDefinition) -> str:
    model = definition.model
    assert model is not None  # load_servable_config guarantees it
    if (model.rank_size, model.stage_size) == (group.rank_size, group.stage_size):
        return ""
    return (
        f"{definition.path} declares rank_size {model.rank_size}, stage_size {model.stage_size}; "
        f"group.json of {group.servable} v{group.version} has rank_size {group.rank_size}, "
        f"stage_size {group.stage_size}"
    )


def plan_method(group: GroupConfig, method: MethodDefinition) -> MethodPlan:
    """Map a model-only method onto the group's signature; ValueError says why it cannot."""
    for stage in method.stages:
        if not stage.is_model:
            raise ValueError(
                f"stage {stage.index} ({stage.tag}) is a Python stage; Python pre/post-processing "
                "stages are not supported by this scheduler yet"
            )
    if len(method.stages) != 1:
        raise ValueError(
            f"the method runs the model {len(method.stages)} times; exactly once is supported"
        )
    stage = method.stages[0]
    if len(stage.inputs) != len(group.inputs):
        raise ValueError(
            f"the method passes {len(stage.inputs)} input(s) to the model, group.json declares "
            f"{len(group.inputs)} ({', '.join(s.name for s in group.inputs)})"
        )
    if stage.outputs_count != len(group.outputs):
        raise ValueError(
            f"outputs_count is {stage.outputs_count}, group.json declares {len(group.outputs)} "
            f"output(s) ({', '.join(s.name for s in group.outputs)})"
        )
    return _model_only_plan(group, method)


def _model_only_plan(group: GroupConfig, method: MethodDefinition) -> MethodPlan:
    stage = method.stages[0]
    spec_of_input: dict[str, TensorSpec] = {}
    input_map: list[tuple[str, str]] = []
    for model_spec, placeholder in zip(group.inputs, stage.inputs, strict=True):
        input_map.append((model_spec.name, placeholder.name))
        spec_of_input[placeholder.name] = model_spec.model_copy(update={"name": placeholder.name})
    unused = [n for n in method.input_names if n not in spec_of_input]
    if unused:
        raise ValueError(f"method input(s) {', '.join(unused)} are not passed to the model")
    output_map: list[tuple[str, str]] = []
    outputs: list[TensorSpec] = []
    for out_name, placeholder in zip(method.output_names, method.outputs, strict=True):
        if placeholder.stage != stage.index:
            raise ValueError(f"output {out_name!r} is not an output of the model stage")
        model_spec = group.outputs[placeholder.index]
        output_map.append((out_name, model_spec.name))
        outputs.append(model_spec.model_copy(update={"name": out_name}))
    inputs = tuple(spec_of_input[n] for n in method.input_names)
    return MethodPlan(method.name, inputs, tuple(outputs), tuple(input_map), tuple(output_map))
