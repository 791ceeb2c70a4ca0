"""Exporters: build a model and write it as per-rank ONNX slices into a model repository.

Each exporter cuts its network into pipeline stages (consecutive rank blocks) and, inside
a stage, splits weights across the stage's ranks (tensor parallel); the stage program in
group.json glues the per-rank segments together with allgather/allreduce. ``common``
holds the deterministic ONNX writer and repository layout that every exporter shares.
"""

from shardserve.tools.common import ExportPlan, GraphBuilder, Progress, StagePlan, write_version
from shardserve.tools.export.matmul import export_matmul
from shardserve.tools.export.mlp import export_mlp

__all__ = [
    "ExportPlan",
    "GraphBuilder",
    "Progress",
    "StagePlan",
    "export_matmul",
    "export_mlp",
    "write_version",
]
