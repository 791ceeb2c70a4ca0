"""Checking a request's tensors against a method signature, with messages that name the
problem. Used by the gateway (so bad input never reaches the broker) and by the scheduler
(so queue-level callers get the same checks)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shardserve.errors import BadInputError
from shardserve.protocol import TensorSpec
from shardserve.tensors import DATATYPE_TO_DTYPE, Tensor

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
