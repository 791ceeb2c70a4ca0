"""``lite.Tensor``: a named model input or output, as in MindSpore Lite's Python API.

An input tensor comes from ``Model.get_inputs()`` with the declared name, dtype and shape
(``-1`` = any size) and no data until ``set_data_from_numpy``; an output tensor comes
from ``Model.predict`` holding its data.
"""

from __future__ import annotations

import numpy as np

from shardserve.lite.errors import LiteError
from shardserve.wire.protocol import TensorSpec
from shardserve.wire.tensors import DATATYPE_TO_DTYPE


class Tensor:
    """One named tensor: ``name``, ``shape``, ``dtype``, ``data_size``, ``element_num``."""

    def __init__(
        self, name: str, dtype: np.dtype, shape: tuple[int, ...], data: np.ndarray | None = None
    ) -> None:
        self.name = name
        self.dtype = dtype
        self._declared = shape
        self._data = data

    @classmethod
    def from_spec(cls, spec: TensorSpec) -> Tensor:
        """An empty input tensor as the group declares it."""
        return cls(spec.name, np.dtype(DATATYPE_TO_DTYPE[spec.datatype]), tuple(spec.shape))

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray) -> Tensor:
        """An output tensor holding ``array``."""
        return cls(name, array.dtype, tuple(array.shape), array)

    @property
    def shape(self) -> tuple[int, ...]:
        """The data's shape once set, else the declared one (``-1`` = any size)."""
        return tuple(self._data.shape) if self._data is not None else self._declared

    @property
    def has_data(self) -> bool:
        return self._data is not None

    @property
    def element_num(self) -> int:
        return int(self._data.size) if self._data is not None else 0

    @property
    def data_size(self) -> int:
        """Size of the data in bytes (0 before any data is set)."""
        return int(self._data.nbytes) if self._data is not None else 0

    def set_data_from_numpy(self, array: np.ndarray) -> None:
        """Set the data; its dtype and shape must match the declaration."""
        if array.dtype != self.dtype:
            raise LiteError(f"tensor {self.name} is {self.dtype}, got data of dtype {array.dtype}")
        if not _fits(self._declared, tuple(array.shape)):
            raise LiteError(
                f"tensor {self.name} has shape {list(self._declared)}, got data of shape "
                f"{list(array.shape)}"
            )
        self._data = np.ascontiguousarray(array)

    def get_data_to_numpy(self) -> np.ndarray:
        if self._data is None:
            raise LiteError(f"tensor {self.name} has no data (call set_data_from_numpy first)")
        return self._data

    def fill_ones(self) -> None:
        """Data of ones in the declared shape (any-size dimensions become 1)."""
        shape = tuple(1 if d < 0 else d for d in self._declared)
        self.set_data_from_numpy(np.ones(shape, dtype=self.dtype))

    def __repr__(self) -> str:
        return f"Tensor(name={self.name!r}, dtype={self.dtype}, shape={list(self.shape)})"


def _fits(declared: tuple[int, ...], actual: tuple[int, ...]) -> bool:
    return len(declared) == len(actual) and all(
        d < 0 or d == a for d, a in zip(declared, actual, strict=True)
    )
