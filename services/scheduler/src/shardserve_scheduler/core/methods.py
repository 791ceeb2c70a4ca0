"""A servable method as the scheduler runs it: a chain of steps over named values.

A method is MindSpore's static DAG of stages (numbered from 1): the distributed model, or
Python functions (pre-/post-processing). Each value is a ``Ref`` = (stage, output index);
stage 0 holds the method's inputs. An instance carries an environment Ref -> Tensor and
walks the steps in order.

Signature for the gateway: a method input passed straight to the model has the model
input's datatype and shape; any other input (one only a Python stage reads) is known by
name only: datatype ``ANY``, shape (). Outputs likewise: a model output keeps its spec,
a Python stage's output is ``ANY``/().
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardserve.repo.repository import GroupConfig
from shardserve.repo.signature import ANY_DATATYPE
from shardserve.servable import DistributedModel, MethodDefinition, Stage
from shardserve.wire.protocol import TensorMap, TensorSpec
from shardserve.wire.tensors import Tensor

Ref = tuple[int, int]  # (stage index from 1, or 0 for the method inputs; output index)
Env = dict[Ref, Tensor]

DEFAULT_METHOD = "predict"


@dataclass(frozen=True)
class ModelStep:
    """Run the distributed model; ``inputs`` are given in the model's input order."""

    index: int
    inputs: tuple[Ref, ...]
    tag: str = "Model"


@dataclass(frozen=True)
class PythonStep:
    """Call a Python function per instance (batch_size None) or on a list of instances."""

    index: int
    tag: str
    function: Callable[..., Any]
    inputs: tuple[Ref, ...]
    outputs_count: int
    batch_size: int | None = None


Step = ModelStep | PythonStep


@dataclass(frozen=True)
class MethodPlan:
    """A method of one servable version: its signature and its steps."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    steps: tuple[Step, ...]
    output_refs: tuple[Ref, ...]
    model_inputs_names: tuple[str, ...]
    model_outputs_names: tuple[str, ...]
    no_batch_inputs: frozenset[str] = field(default_factory=frozenset)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    def start_env(self, instance: Mapping[str, Tensor]) -> Env:
        return {(0, i): instance[spec.name] for i, spec in enumerate(self.inputs)}

    def model_inputs(self, step: ModelStep, env: Env) -> TensorMap:
        return {
            name: env[ref] for name, ref in zip(self.model_inputs_names, step.inputs, strict=True)
        }

    def store_model_outputs(self, step: ModelStep, env: Env, outputs: TensorMap) -> None:
        for j, name in enumerate(self.model_outputs_names):
            env[(step.index, j)] = outputs[name]

    def method_outputs(self, env: Env, wanted: tuple[str, ...] | None) -> TensorMap:
        """The method's named outputs, keeping only ``wanted`` if given."""
        keep = set(wanted) if wanted else None
        return {
            spec.name: env[ref]
            for spec, ref in zip(self.outputs, self.output_refs, strict=True)
            if keep is None or spec.name in keep
        }


def default_method(group: GroupConfig) -> MethodPlan:
    """``predict`` = the model, with the group's inputs and outputs (no servable_config.py)."""
    step = ModelStep(1, tuple((0, i) for i in range(len(group.inputs))))
    return MethodPlan(
        DEFAULT_METHOD,
        group.inputs,
        group.outputs,
        (step,),
        tuple((1, j) for j in range(len(group.outputs))),
        tuple(s.name for s in group.inputs),
        tuple(s.name for s in group.outputs),
    )


def plan_method(
    group: GroupConfig, method: MethodDefinition, model: DistributedModel | None = None
) -> MethodPlan:
    """Turn a recorded method into steps over this group; ValueError says why it cannot."""
    steps = tuple(_step(group, stage) for stage in method.stages)
    used = {ref for step in steps for ref in step.inputs} | {
        (p.stage, p.index) for p in method.outputs
    }
    unused = [n for i, n in enumerate(method.input_names) if (0, i) not in used]
    if unused:
        raise ValueError(f"method input(s) {', '.join(unused)} are not used by any stage")
    output_refs = tuple((p.stage, p.index) for p in method.outputs)
    inputs = tuple(_input_spec(group, steps, i, name) for i, name in enumerate(method.input_names))
    outputs = tuple(
        _output_spec(group, steps, inputs, ref, name)
        for ref, name in zip(output_refs, method.output_names, strict=True)
    )
    no_batch = frozenset(
        group.inputs[i].name
        for i in (model.without_batch_dim_inputs if model else ())
        if i < len(group.inputs)
    )
    return MethodPlan(
        method.name,
        inputs,
        outputs,
        steps,
        output_refs,
        tuple(s.name for s in group.inputs),
        tuple(s.name for s in group.outputs),
        no_batch,
    )


def _step(group: GroupConfig, stage: Stage) -> Step:
    refs = tuple((p.stage, p.index) for p in stage.inputs)
    if not stage.is_model:
        batch = stage.batch_size
        if batch is not None and (not isinstance(batch, int) or batch < 0):
            raise ValueError(f"stage {stage.index} ({stage.tag}): batch_size must be None or >= 0")
        return PythonStep(stage.index, stage.tag, stage.target, refs, stage.outputs_count, batch)  # type: ignore[arg-type]
    if len(refs) != len(group.inputs):
        raise ValueError(
            f"stage {stage.index} passes {len(refs)} input(s) to the model, group.json declares "
            f"{len(group.inputs)} ({', '.join(s.name for s in group.inputs)})"
        )
    if stage.outputs_count != len(group.outputs):
        raise ValueError(
            f"stage {stage.index}: outputs_count is {stage.outputs_count}, group.json declares "
            f"{len(group.outputs)} output(s) ({', '.join(s.name for s in group.outputs)})"
        )
    return ModelStep(stage.index, refs, stage.tag or "Model")


def _input_spec(group: GroupConfig, steps: tuple[Step, ...], i: int, name: str) -> TensorSpec:
    for step in steps:
        if isinstance(step, ModelStep) and (0, i) in step.inputs:
            spec = group.inputs[step.inputs.index((0, i))]
            return spec.model_copy(update={"name": name})
    return TensorSpec(name=name, datatype=ANY_DATATYPE, shape=())


def _output_spec(
    group: GroupConfig,
    steps: tuple[Step, ...],
    inputs: tuple[TensorSpec, ...],
    ref: Ref,
    name: str,
) -> TensorSpec:
    stage, index = ref
    if stage == 0:
        return inputs[index].model_copy(update={"name": name})
    step = steps[stage - 1]
    if isinstance(step, ModelStep):
        return group.outputs[index].model_copy(update={"name": name})
    return TensorSpec(name=name, datatype=ANY_DATATYPE, shape=())
