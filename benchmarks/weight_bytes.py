"""The weight bytes a rank reads per decode token, from its slice's ONNX files.

A decode step reads every initializer whole, except a table only indexed by ``Gather``
(the token embedding: one row per token). Sizes come from each initializer's shape and
element type, so the files' external data need not be loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper


def initializer_bytes(tensor: onnx.TensorProto) -> int:
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def indexed_only(graph: onnx.GraphProto) -> set[str]:
    """Initializers every consumer of which is a ``Gather`` reading it as its data input."""
    readers: dict[str, list[bool]] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append(node.op_type == "Gather" and position == 0)
    return {name for name, gathers in readers.items() if gathers and all(gathers)}


def bytes_per_token(model: onnx.ModelProto) -> int:
    """Bytes of the initializers a decode step reads whole."""
    graph = model.graph
    skipped = indexed_only(graph)
    return sum(initializer_bytes(t) for t in graph.initializer if t.name not in skipped)


def rank_bytes_per_token(folder: Path) -> int:
    """Summed over every ``*.onnx`` of a rank's slice folder."""
    return sum(
        bytes_per_token(onnx.load(str(path), load_external_data=False))
        for path in sorted(folder.glob("*.onnx"))
    )
