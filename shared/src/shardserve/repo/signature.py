"""Checking a request's tensors against a method signature, with messages that name the
problem. Used by the gateway (so bad input never reaches the broker) and by the scheduler
(so queue-level callers get the same checks)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from shardserve.errors import BadInputError
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import DATATYPE_TO_DTYPE, Tensor

ANY_DATATYPE = "ANY"  # a Python-stage method input whose type is not known statically


def check_instance(
    inputs: Mapping[str, Tensor], specs: Iterable[TensorSpec], *, batch_dim: bool = False
) -> None:
    """Raise BadInputError naming the first missing/extra input, datatype or shape problem."""
    expected = {s.name: s for s in specs}
    missing = [n for n in expected if n not in inputs]
    if missing:
        raise BadInputError(f"missing input(s): {', '.join(missing)}; expected {sorted(expected)}")
    extra = [n for n in inputs if n not in expected]
    if extra:
        raise BadInputError(f"unexpected input(s): {', '.join(extra)}; expected {sorted(expected)}")
    for name, tensor in inputs.items():
        check_tensor(name, tensor, expected[name], batch_dim=batch_dim)


def check_tensor(name: str, tensor: Tensor, spec: TensorSpec, *, batch_dim: bool = False) -> None:
    """Check one tensor's datatype and shape against its spec (-1 matches any size)."""
    if spec.datatype != ANY_DATATYPE and tensor.dtype != DATATYPE_TO_DTYPE.get(spec.datatype):
        raise BadInputError(
            f"input {name!r} has datatype {tensor.datatype}, expected {spec.datatype}"
        )
    if spec.datatype == ANY_DATATYPE:
        return
    if not shape_matches(tensor.shape, spec.shape, batch_dim=batch_dim):
        raise BadInputError(
            f"input {name!r} has shape {list(tensor.shape)}, expected {list(spec.shape)}"
        )
    if spec.max_shape is not None:
        check_max_shape(name, tensor.shape, spec.max_shape, batch_dim=batch_dim)
    if spec.min_value is not None or spec.max_value is not None:
        check_values(name, tensor, spec.min_value, spec.max_value)


def check_max_shape(
    name: str, shape: tuple[int, ...], max_shape: tuple[int, ...], *, batch_dim: bool
) -> None:
    """Refuse a dimension past its upper bound (-1 = unbounded; with ``batch_dim``, dim 0 is the
    batch and is bounded by batching, not by the signature)."""
    for i, (got, limit) in enumerate(zip(shape, max_shape, strict=False)):
        if limit < 0 or (batch_dim and i == 0):
            continue
        if got > limit:
            raise BadInputError(f"input {name!r} dimension {i} is {got}, at most {limit} allowed")


def check_values(name: str, tensor: Tensor, low: float | None, high: float | None) -> None:
    """Refuse elements outside [low, high] (inclusive; NaN is always outside)."""
    array = tensor.to_numpy()
    if array.size == 0 or array.dtype.kind not in "biuf":
        return  # nothing to compare (BYTES inputs have no numeric order)
    smallest, largest = array.min(), array.max()
    bounds = f"[{_number(low, -math.inf)}, {_number(high, math.inf)}]"
    if np.isnan(smallest) or np.isnan(largest):
        raise BadInputError(f"input {name!r} has values outside {bounds}: found nan")
    # Compare as Python numbers: exact for int64 (no float rounding of large ids).
    if low is not None and smallest.item() < low:
        raise BadInputError(f"input {name!r} has values outside {bounds}: found {smallest.item()}")
    if high is not None and largest.item() > high:
        raise BadInputError(f"input {name!r} has values outside {bounds}: found {largest.item()}")


def _number(value: float | None, default: float) -> str:
    """A bound as people write it: 63 rather than 63.0, -inf/inf when unset."""
    value = default if value is None else value
    if math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return str(value)


def shape_matches(shape: tuple[int, ...], spec: tuple[int, ...], *, batch_dim: bool) -> bool:
    """Whether ``shape`` fits ``spec``; with ``batch_dim`` dim 0 may be any size >= 1."""
    if len(shape) != len(spec):
        return False
    for i, (got, want) in enumerate(zip(shape, spec, strict=True)):
        if want == -1 or (batch_dim and i == 0):
            continue
        if got != want:
            return False
    return True
