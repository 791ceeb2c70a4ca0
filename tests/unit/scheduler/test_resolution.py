"""Servable configs, version and method resolution, input validation (files, no broker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.errors import ErrorCode, InferenceError
from shardserve.repo.repository import write_group
from shardserve.repo.signature import ANY_DATATYPE
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core.catalog import Catalog, load_catalog
from shardserve_scheduler.core.methods import ModelStep, PythonStep
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.core.resolve import resolve
from shardserve_scheduler.core.status import mesh_status

MODEL_CONFIG = """
from shardserve.servable import add_stage, declare_servable, register_method

model = declare_servable(rank_size=2, stage_size=1, with_batch_dim=False)


@register_method(output_names=["out"])
def compute(a):
    return add_stage(model, a, outputs_count=1)


def double(a):
    return a * 2


@register_method(output_names=["out"])
def with_python(a):
    b = add_stage(double, a, outputs_count=1, tag="Preprocess")
    return add_stage(model, b, outputs_count=1)
"""

BROKEN_CONFIG = """
from shardserve.servable import declare_servable

model = declare_servable(rank_size=2, stage_size=1)
raise RuntimeError("cannot import my tokenizer")
"""


def add_version(kit: Any, repo: Path, servable: str, version: int) -> None:
    folder = repo / servable / str(version)
    folder.mkdir(parents=True)
    write_group(folder, kit.group(servable=servable, version=version))


@pytest.fixture
def repo(kit: Any, tmp_path: Path) -> Path:
    for version in (1, 2):
        add_version(kit, tmp_path, "matmul", version)
    add_version(kit, tmp_path, "custom", 1)
    (tmp_path / "custom" / "servable_config.py").write_text(MODEL_CONFIG)
    add_version(kit, tmp_path, "broken", 1)
    (tmp_path / "broken" / "servable_config.py").write_text(BROKEN_CONFIG)
    return tmp_path


def ready(registry: Registry, kit: Any, servable: str, version: int) -> None:
    for rank in range(2):
        kit.join(
            registry, rank, 0.0, f"{servable}-{version}-{rank}", servable=servable, version=version
        )


def refusal(catalog: Catalog, registry: Registry, request: Any) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        resolve(catalog, registry, request, "reply.q", "c")
    return info.value


def setup(repo: Path) -> tuple[Catalog, Registry]:
    catalog = load_catalog(repo)
    return catalog, Registry.build(catalog.groups(), 0.0)


def test_version_zero_is_the_highest_ready_version(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "matmul", 1)
    call = resolve(catalog, registry, kit.request(version=0), "reply.q", "c")
    assert call.group.version == 1 and call.method.name == "predict"
    ready(registry, kit, "matmul", 2)
    assert resolve(catalog, registry, kit.request(version=0), "r", "c").group.version == 2


def test_no_ready_version_names_the_missing_ranks(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    kit.join(registry, 0, 0.0, servable="matmul", version=2)
    err = refusal(catalog, registry, kit.request(version=0))
    assert err.code == ErrorCode.UNAVAILABLE
    assert err.message == "matmul v2 is not ready: rank 1 missing"
    err = refusal(catalog, registry, kit.request(version=1))
    assert err.message == "matmul v1 is not ready: ranks 0, 1 missing"


def test_unknown_servable_version_and_method(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "matmul", 1)
    err = refusal(catalog, registry, kit.request(servable="nope"))
    assert err.code == ErrorCode.NOT_FOUND
    assert err.message == "servable 'nope' not found; servables: broken, custom, matmul"
    err = refusal(catalog, registry, kit.request(version=7))
    assert err.code == ErrorCode.NOT_FOUND
    assert err.message == "servable matmul version 7 not found; versions: 1, 2"
    err = refusal(catalog, registry, kit.request(version=1, method="classify"))
    assert err.code == ErrorCode.NOT_FOUND
    assert err.message == "method 'classify' not found for servable matmul; methods: predict"


def test_bad_inputs_and_outputs_are_refused(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "matmul", 1)
    wrong_shape = kit.request().model_copy(
        update={"instances": ({"x": Tensor.from_numpy(np.ones((3, 3), np.float32))},)}
    )
    err = refusal(catalog, registry, wrong_shape)
    assert err.code == ErrorCode.BAD_INPUT
    assert err.message == "input 'x' has shape [3, 3], expected [2, 3]"
    two = kit.request(instances=2)
    two = two.model_copy(update={"instances": (two.instances[0], {"z": kit.tensor()})})
    err = refusal(catalog, registry, two)
    assert err.message.startswith("instance 1: missing input(s): x")
    short = Tensor(dtype="<f4", shape=(2, 3), data=b"\0" * 8)
    err = refusal(
        catalog, registry, kit.request().model_copy(update={"instances": ({"x": short},)})
    )
    assert err.code == ErrorCode.BAD_INPUT and "needs 24" in err.message
    err = refusal(catalog, registry, kit.request(outputs=("nope",)))
    assert err.message == "unknown output(s) nope; outputs of predict: y"


def test_config_methods_map_their_names_onto_the_model(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "custom", 1)
    request = kit.request(servable="custom", method="compute").model_copy(
        update={"instances": ({"a": kit.tensor(5.0)},)}
    )
    call = resolve(catalog, registry, request, "reply.q", "c")
    plan = call.method
    env = plan.start_env(request.instances[0])
    (step,) = plan.steps
    assert isinstance(step, ModelStep)
    assert set(plan.model_inputs(step, env)) == {"x"}
    plan.store_model_outputs(step, env, {"y": kit.tensor(1.0)})
    assert set(plan.method_outputs(env, None)) == {"out"}
    assert [s.name for s in plan.inputs] == ["a"]
    assert plan.inputs[0].datatype == "FP32" and plan.outputs[0].shape == (2, 3)


def test_python_stage_methods_are_served_with_any_typed_inputs(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "custom", 1)
    request = kit.request(servable="custom", method="with_python").model_copy(
        update={"instances": ({"a": Tensor.from_numpy(np.arange(3))},)}
    )
    call = resolve(catalog, registry, request, "reply.q", "c")
    plan = call.method
    assert [type(s).__name__ for s in plan.steps] == ["PythonStep", "ModelStep"]
    # known only by name: the Python stage decides what it accepts
    assert plan.inputs == (TensorSpec(name="a", datatype=ANY_DATATYPE, shape=()),)
    assert plan.outputs == (TensorSpec(name="out", datatype="FP32", shape=(2, 3)),)
    python = plan.steps[0]
    assert isinstance(python, PythonStep) and python.tag == "Preprocess"


def test_a_broken_config_isolates_its_servable(
    kit: Any, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    catalog, registry = setup(repo)
    config = repo / "broken" / "servable_config.py"
    assert any(
        f"{config}:5: cannot import my tokenizer" in r.getMessage() and r.levelname == "ERROR"
        for r in caplog.records
    )
    ready(registry, kit, "broken", 1)
    err = refusal(catalog, registry, kit.request(servable="broken"))
    assert err.code == ErrorCode.UNAVAILABLE
    assert err.message == f"servable broken is unavailable: {config}:5: cannot import my tokenizer"
    ready(registry, kit, "matmul", 2)
    assert resolve(catalog, registry, kit.request(), "r", "c").group.version == 2


def test_config_that_disagrees_with_group_json(kit: Any, repo: Path) -> None:
    (repo / "custom" / "servable_config.py").write_text(
        MODEL_CONFIG.replace("rank_size=2", "rank_size=4")
    )
    catalog, registry = setup(repo)
    ready(registry, kit, "custom", 1)
    err = refusal(catalog, registry, kit.request(servable="custom", method="compute"))
    assert "declares rank_size 4, stage_size 1" in err.message
    assert "group.json of custom v1 has rank_size 2" in err.message


def test_status_lists_methods_ranks_and_reasons(kit: Any, repo: Path) -> None:
    catalog, registry = setup(repo)
    ready(registry, kit, "matmul", 1)
    status = mesh_status(
        "sched", catalog, registry, RequestMachine(result_to="q", id_prefix="t"), 1.0
    )
    by_key = {(s.name, s.version): s for s in status.servables}
    v1 = by_key[("matmul", 1)]
    assert v1.ready and v1.reason == "" and [m.name for m in v1.methods] == ["predict"]
    assert [r.state for r in v1.ranks] == ["ready", "ready"]
    assert [r.heartbeat_age_s for r in v1.ranks] == [1.0, 1.0]
    assert not by_key[("matmul", 2)].ready
    assert by_key[("matmul", 2)].reason == "matmul v2 is not ready: ranks 0, 1 missing"
    broken = by_key[("broken", 1)]
    assert not broken.ready and "cannot import my tokenizer" in broken.reason
    assert [m.name for m in by_key[("custom", 1)].methods] == ["compute", "with_python"]
    assert v1.state == "available" and by_key[("matmul", 2)].state == "loading"
    assert broken.state == "failed"
