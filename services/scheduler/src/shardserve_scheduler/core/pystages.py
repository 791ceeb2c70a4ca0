"""Running one Python stage task: tensors in, the user's function, tensors (or errors) out.

``run_python_task`` is what a worker thread executes; it never raises. The function gets
numpy arrays (a one-element BYTES tensor arrives as ``str`` when it is valid UTF-8, else
``bytes``), and may return numpy arrays, numpy scalars, bool, int, float, str or bytes.

Errors follow MindSpore Serving: each failing instance gets
``"Call {tag} Failed, method: '{method}', stage index(begin with 1): {k}, error msg: {e}"``.
The code is BAD_INPUT (HTTP 400) when the function raised ValueError, TypeError or
KeyError (the usual signs of input the function cannot take), STAGE_FAILED (500) for any
other exception, for an unsupported return value, and when a batched function returns
the wrong number of results (then every instance of the task fails).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo
from shardserve.wire.tensors import BYTES_DTYPE, Tensor
from shardserve_scheduler.core.methods import PythonStep

_INPUT_ERRORS = (ValueError, TypeError, KeyError)

Outcome = tuple[Tensor, ...] | ErrorInfo


@dataclass(frozen=True)
class PythonTask:
    """One call of a Python stage: one instance, or a list of them for a batched stage."""

    id: str
    method: str
    step: PythonStep
    args: tuple[tuple[Tensor, ...], ...]

    @property
    def batched(self) -> bool:
        return self.step.batch_size is not None


def run_python_task(task: PythonTask) -> list[Outcome]:
    """One outcome per instance, in order; never raises."""
    if task.batched:
        return _run_batched(task)
    return [_run_one(task, args) for args in task.args]


def _run_one(task: PythonTask, args: tuple[Tensor, ...]) -> Outcome:
    try:
        returned = task.step.function(*(to_python(t) for t in args))
    except Exception as exc:
        return stage_error(task, exc)
    return _outputs(task, returned)


def _run_batched(task: PythonTask) -> list[Outcome]:
    instances = [tuple(to_python(t) for t in args) for args in task.args]
    try:
        returned = task.step.function(instances)
        results = list(returned) if isinstance(returned, Iterable) else None
    except Exception as exc:
        return [stage_error(task, exc)] * len(instances)
    if results is None or len(results) != len(instances):
        got = "no iterable" if results is None else f"{len(results)} result(s)"
        problem = RuntimeError(f"the function returned {got} for {len(instances)} instance(s)")
        return [stage_error(task, problem, ErrorCode.STAGE_FAILED)] * len(instances)
    return [_outputs(task, r) for r in results]


def _outputs(task: PythonTask, returned: Any) -> Outcome:
    count = task.step.outputs_count
    values = returned if count > 1 and isinstance(returned, (tuple, list)) else (returned,)
    if len(values) != count:
        problem = RuntimeError(f"returned {len(values)} output(s), outputs_count is {count}")
        return stage_error(task, problem, ErrorCode.STAGE_FAILED)
    try:
        return tuple(to_tensor(v) for v in values)
    except (TypeError, ValueError) as exc:
        return stage_error(task, exc, ErrorCode.STAGE_FAILED)


def stage_error(task: PythonTask, exc: BaseException, code: ErrorCode | None = None) -> ErrorInfo:
    if code is None:
        code = ErrorCode.BAD_INPUT if isinstance(exc, _INPUT_ERRORS) else ErrorCode.STAGE_FAILED
    message = (
        f"Call {task.step.tag} Failed, method: '{task.method}', "
        f"stage index(begin with 1): {task.step.index}, error msg: {exc}"
    )
    return ErrorInfo(code=code, message=message)


def to_python(tensor: Tensor) -> Any:
    """A stage input as the function sees it."""
    array = tensor.to_numpy()
    if tensor.dtype == BYTES_DTYPE and array.size == 1:
        raw: bytes = array.reshape(-1)[0]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    return array


def to_tensor(value: Any) -> Tensor:
    """A function's return value as a tensor (TypeError for anything unsupported)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (str, bytes)):
        items = np.empty((), dtype=object)
        items[()] = value
        return Tensor.from_numpy(items)
    if isinstance(value, (bool, int, float, np.generic)):
        return Tensor.from_numpy(np.asarray(value))
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufSUO":
            raise TypeError(f"unsupported numpy dtype {value.dtype} in a stage output")
        return Tensor.from_numpy(value)
    raise TypeError(
        f"stage output of type {type(value).__name__} is not supported "
        "(numpy array or scalar, bool, int, float, str, bytes)"
    )
