"""Value/dimension bounds from group.json reach the scheduler's checks and its MeshStatus
(which the gateway validates against), also through a servable_config method's renaming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.errors import ErrorCode, InferenceError
from shardserve.repo.repository import write_group
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core.catalog import load_catalog
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.core.resolve import resolve
from shardserve_scheduler.core.status import mesh_status

BOUNDED = TensorSpec(
    name="x", datatype="FP32", shape=(2, 3), min_value=0.0, max_value=1.0, max_shape=(2, 3)
)
RENAMING_CONFIG = """
from shardserve.servable import add_stage, declare_servable, register_method

model = declare_servable(rank_size=2, stage_size=1, with_batch_dim=False)


@register_method(output_names=["out"])
def compute(a):
    return add_stage(model, a, outputs_count=1)
"""


@pytest.fixture
def repo(kit: Any, tmp_path: Path) -> Path:
    for servable in ("matmul", "custom"):
        folder = tmp_path / servable / "1"
        folder.mkdir(parents=True)
        group = kit.group(servable=servable).model_copy(update={"inputs": (BOUNDED,)})
        write_group(folder, group)
    (tmp_path / "custom" / "servable_config.py").write_text(RENAMING_CONFIG)
    return tmp_path


def ready_registry(kit: Any, repo: Path) -> tuple[Any, Registry]:
    catalog = load_catalog(repo)
    registry = Registry.build(catalog.groups(), 0.0)
    for servable in ("matmul", "custom"):
        for rank in range(2):
            kit.join(registry, rank, 0.0, f"{servable}-{rank}", servable=servable, version=1)
    return catalog, registry


def test_status_methods_carry_the_bounds(kit: Any, repo: Path) -> None:
    catalog, registry = ready_registry(kit, repo)
    status = mesh_status("s", catalog, registry, RequestMachine(result_to="q", id_prefix="t"), 1.0)
    specs = {s.name: s.methods[0].inputs[0] for s in status.servables}
    assert specs["matmul"] == BOUNDED
    assert specs["custom"] == BOUNDED.model_copy(update={"name": "a"})


@pytest.mark.parametrize(
    ("servable", "method", "name"), [("matmul", "predict", "x"), ("custom", "compute", "a")]
)
def test_values_outside_the_bounds_are_refused_before_any_job(
    kit: Any, repo: Path, servable: str, method: str, name: str
) -> None:
    catalog, registry = ready_registry(kit, repo)
    values = np.full((2, 3), 0.5, np.float32)
    values[1, 2] = 7.0
    request = kit.request(servable=servable, method=method).model_copy(
        update={"instances": ({name: Tensor.from_numpy(values)},)}
    )
    with pytest.raises(InferenceError) as info:
        resolve(catalog, registry, request, "reply.q", "c")
    assert info.value.code == ErrorCode.BAD_INPUT
    assert info.value.message == f"input {name!r} has values outside [0, 1]: found 7.0"
