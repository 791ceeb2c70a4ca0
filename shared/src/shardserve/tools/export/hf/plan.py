"""How a decoder spreads over ranks: layers over stages, heads and MLP features over the
ranks of a stage (Megatron style), the vocabulary of the LM head. Impossible layouts are
refused with the reason, before any tensor is read."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.errors import ExportError
from shardserve.tools.common import check_layout, split_range
from shardserve.tools.export.hf.config import DecoderConfig

__all__ = ["RankPlan", "plan_rank", "stage_layers"]


@dataclass(frozen=True)
class RankPlan:
    """One rank's share. Head slices index the model's heads; ``vocab`` None = replicated."""

    rank: int
    stage: int
    local: int
    ranks: int  # ranks per stage
    stages: int
    layers: range
    q_heads: slice
    kv_heads: slice
    mlp: slice  # intermediate features (MLP columns, then rows of the down projection)
    vocab: slice | None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def stage_layers(layers: int, stages: int) -> tuple[range, ...]:
    """Layers spread as evenly as possible; the first stages take one more when uneven."""
    if layers < stages:
        raise ExportError(f"{layers} layers cannot fill {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(stages))


def check_split(config: DecoderConfig, ranks: int) -> None:
    """Refuse a tensor-parallel degree the heads or the MLP do not divide."""
    if config.heads % ranks:
        raise ExportError(f"{config.heads} attention heads do not divide over {ranks} ranks")
    kv = config.kv_heads
    if kv >= ranks and kv % ranks:
        raise ExportError(f"{kv} key/value heads do not divide over {ranks} ranks")
    if kv < ranks and ranks % kv:
        raise ExportError(
            f"{kv} key/value heads cannot be replicated evenly over {ranks} ranks "
            f"({ranks} is not a multiple of {kv})"
        )
    if config.intermediate % ranks:
        raise ExportError(
            f"MLP width {config.intermediate} does not divide over {ranks} ranks per stage"
        )


def plan_rank(config: DecoderConfig, rank_size: int, stage_size: int, rank: int) -> RankPlan:
    ranks = check_layout(rank_size, stage_size)
    check_split(config, ranks)
    stage, local = divmod(rank, ranks)
    return RankPlan(
        rank=rank,
        stage=stage,
        local=local,
        ranks=ranks,
        stages=stage_size,
        layers=stage_layers(config.layers, stage_size)[stage],
        q_heads=split_range(config.heads, ranks, local),
        kv_heads=_kv_heads(config.kv_heads, ranks, local),
        mlp=split_range(config.intermediate, ranks, local),
        vocab=split_range(config.vocab, ranks, local) if config.vocab % ranks == 0 else None,
    )


def _kv_heads(kv_heads: int, ranks: int, local: int) -> slice:
    """Split when they divide; fewer K/V heads than ranks: each rank holds the one K/V head
    its query heads use (ranks/kv_heads consecutive ranks share it, as vLLM replicates)."""
    if kv_heads >= ranks:
        return split_range(kv_heads, ranks, local)
    head = local // (ranks // kv_heads)
    return slice(head, head + 1)
