"""Turning what a caller passes into numpy arrays the wire can carry.

Accepted values follow MindSpore Serving's client: numpy arrays and numpy scalars of any
supported dtype, Python ``bool``/``int``/``float`` (a 1-element array, numpy's default
dtype), ``str`` and ``bytes`` (a 1-element BYTES tensor), and nested lists (``np.asarray``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardserve.errors import BadInputError
from shardserve.wire.tensors import BYTES_DTYPE, DTYPE_TO_DATATYPE

Instance = Mapping[str, Any]


def as_array(name: str, value: Any) -> np.ndarray:
    """Return ``value`` as a numpy array, or raise BadInputError naming the input."""
    if isinstance(value, str | bytes):
        out = np.empty(1, dtype=np.object_)
        out[0] = value
        return out
    if isinstance(value, bool | int | float):
        return np.asarray([value])
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged lists and the like
        raise BadInputError(f"input {name!r} is not a tensor: {exc}") from exc
    datatype_of(name, array)  # refuse unsupported dtypes before anything is sent
    return array


def datatype_of(name: str, array: np.ndarray) -> str:
    """The KServe datatype of an array (BYTES for object/str/bytes arrays)."""
    if array.dtype == np.object_:
        _check_bytes_elements(name, array)
        return DTYPE_TO_DATATYPE[BYTES_DTYPE]
    if array.dtype.kind in "SU":
        return DTYPE_TO_DATATYPE[BYTES_DTYPE]
    datatype = DTYPE_TO_DATATYPE.get(array.dtype.newbyteorder("<").str)
    if datatype is None:
        raise BadInputError(f"input {name!r} has unsupported dtype {array.dtype}")
    return datatype


def _check_bytes_elements(name: str, array: np.ndarray) -> None:
    for item in array.reshape(-1):
        if not isinstance(item, str | bytes):
            raise BadInputError(
                f"input {name!r} is a BYTES tensor, its elements must be str or bytes, "
                f"got {type(item).__name__}"
            )


def as_instance(instance: Any) -> dict[str, np.ndarray]:
    """Check one instance (a mapping of input name to value) and convert its values."""
    if not isinstance(instance, Mapping) or not instance:
        raise BadInputError("an instance must be a non-empty dict of input name -> value")
    for name in instance:
        if not isinstance(name, str) or not name:
            raise BadInputError(f"input names must be non-empty strings, got {name!r}")
    return {name: as_array(name, value) for name, value in instance.items()}
