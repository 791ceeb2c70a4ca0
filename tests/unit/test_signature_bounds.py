"""Value and dimension bounds of a TensorSpec: refused with a message naming input and bound."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from shardserve.errors import BadInputError
from shardserve.repo.signature import check_instance, check_tensor
from shardserve.wire.protocol import MethodStatus, TensorSpec
from shardserve.wire.tensors import Tensor

IDS = TensorSpec(
    name="input_ids",
    datatype="INT64",
    shape=(-1, -1),
    min_value=0,
    max_value=63,
    max_shape=(-1, 16),
)


def ids(*rows: list[int]) -> Tensor:
    return Tensor.from_numpy(np.array(rows, dtype=np.int64))


def refusal(tensor: Tensor, spec: TensorSpec = IDS, *, batch_dim: bool = True) -> str:
    with pytest.raises(BadInputError) as caught:
        check_tensor(spec.name, tensor, spec, batch_dim=batch_dim)
    return caught.value.message


def test_values_inside_the_bounds_pass() -> None:
    check_tensor("input_ids", ids([0, 63], [5, 7]), IDS, batch_dim=True)


@pytest.mark.parametrize(("bad", "found"), [(64, "64"), (-1, "-1"), (2**62, str(2**62))])
def test_values_outside_the_bounds_are_named(bad: int, found: str) -> None:
    message = refusal(ids([1, bad, 3]))
    assert message == f"input 'input_ids' has values outside [0, 63]: found {found}"


def test_dimension_past_its_bound_is_named() -> None:
    message = refusal(Tensor.from_numpy(np.zeros((1, 17), np.int64)))
    assert message == "input 'input_ids' dimension 1 is 17, at most 16 allowed"
    check_tensor("input_ids", Tensor.from_numpy(np.zeros((1, 16), np.int64)), IDS, batch_dim=True)


def test_unbounded_dimensions_and_unset_bounds_take_anything() -> None:
    spec = TensorSpec(name="x", datatype="INT64", shape=(-1, -1))
    check_tensor("x", Tensor.from_numpy(np.full((300, 4000), -(2**40), np.int64)), spec)
    wide = IDS.model_copy(update={"max_shape": (-1, -1)})
    check_tensor("input_ids", Tensor.from_numpy(np.zeros((1, 5000), np.int64)), wide)


def test_batch_dimension_is_not_bounded_by_the_signature() -> None:
    spec = IDS.model_copy(update={"max_shape": (2, 16)})
    check_tensor("input_ids", Tensor.from_numpy(np.zeros((9, 4), np.int64)), spec, batch_dim=True)
    message = refusal(Tensor.from_numpy(np.zeros((9, 4), np.int64)), spec, batch_dim=False)
    assert message == "input 'input_ids' dimension 0 is 9, at most 2 allowed"


@pytest.mark.parametrize(
    ("bounds", "value", "expected"),
    [
        ({"min_value": 0.5}, 0.25, "outside [0.5, inf]: found 0.25"),
        ({"max_value": 1.0}, 1.5, "outside [-inf, 1]: found 1.5"),
        ({"min_value": -1.0, "max_value": 1.0}, float("nan"), "outside [-1, 1]: found nan"),
    ],
)
def test_one_sided_and_float_bounds(bounds: dict[str, Any], value: float, expected: str) -> None:
    spec = TensorSpec(name="x", datatype="FP32", shape=(-1,), **bounds)
    message = refusal(Tensor.from_numpy(np.array([0.75, value], np.float32)), spec)
    assert message == f"input 'x' has values {expected}"


def test_empty_tensor_has_no_values_to_refuse() -> None:
    check_tensor("input_ids", Tensor.from_numpy(np.zeros((1, 0), np.int64)), IDS, batch_dim=True)


def test_shape_and_datatype_are_checked_before_values() -> None:
    assert "datatype FP32" in refusal(Tensor.from_numpy(np.full((1, 2), 99.0, np.float32)))
    assert "expected [-1, -1]" in refusal(Tensor.from_numpy(np.full((3,), 99, np.int64)))


def test_check_instance_applies_the_bounds() -> None:
    with pytest.raises(BadInputError, match=r"outside \[0, 63\]: found 99"):
        check_instance({"input_ids": ids([99])}, [IDS], batch_dim=True)


def test_bounds_survive_the_wire_and_default_to_none() -> None:
    method = MethodStatus(name="predict", inputs=(IDS,), outputs=())
    assert MethodStatus.model_validate(method.model_dump(mode="json")) == method
    legacy = TensorSpec.model_validate({"name": "x", "datatype": "FP32", "shape": [2]})
    assert (legacy.min_value, legacy.max_value, legacy.max_shape) == (None, None, None)


@pytest.mark.parametrize(
    "bad",
    [{"max_shape": (16,)}, {"min_value": 5, "max_value": 1}],
)
def test_inconsistent_bounds_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        TensorSpec(name="x", datatype="INT64", shape=(-1, -1), **bad)
