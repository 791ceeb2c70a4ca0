"""What one rank of a generation servable caches per token, read from its group.json.

A servable generates text when its stage programs hold ``attention`` ops (the HF exporter
writes them); each rank then caches K and V of the layers its stage runs, for its share
of the K/V heads. The agent sizes its ``KVCache`` from this; offline runners do the same.
"""

from __future__ import annotations

from shardserve.repo.repository import AttentionOp, GroupConfig
from shardserve.runtime.kv_cache import CacheShape

__all__ = ["cache_shape", "is_generation"]


def is_generation(group: GroupConfig) -> bool:
    """Whether the servable's programs attend over a KV cache (it serves StepWork)."""
    return any(isinstance(op, AttentionOp) for stage in group.stages for op in stage.program)


def cache_shape(group: GroupConfig, rank: int) -> CacheShape:
    """The layers whose attention a rank runs, and its share of K/V heads (replicated when
    there are fewer K/V heads than ranks per stage)."""
    stage = group.stage_of(rank)
    layers = tuple(op.layer for op in stage.program if isinstance(op, AttentionOp))
    kv_heads = int(group.origin["kv_heads"])
    return CacheShape(
        layers, max(1, kv_heads // group.ranks_per_stage), int(group.origin["head_dim"])
    )
