"""Slicing existing ONNX models: pipeline stages, tensor parallel, external data checks."""

from shardserve.repo.external import check_external_data
from shardserve.tools.slice_writer import (
    EXTERNAL_DATA_THRESHOLD,
    RankSlice,
    SliceLayout,
    write_slices,
)
from shardserve.tools.slicing.api import load_model, slice_pipeline, tensor_parallel

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "RankSlice",
    "SliceLayout",
    "check_external_data",
    "load_model",
    "slice_pipeline",
    "tensor_parallel",
    "write_slices",
]
