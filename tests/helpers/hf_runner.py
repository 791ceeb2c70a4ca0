"""Runs an exported Hugging Face group step by step in this process: every rank's slice
through ``run_group_locally`` (real onnxruntime, local collectives) with its own KV cache."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shardserve.repo.repository import GroupConfig, load_group, verify_rank_files
from shardserve.runtime.attention import StepAttention, StepLayout
from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.kv_shape import cache_shape
from shardserve.runtime.pieces import ComposedRank, open_pieces
from shardserve.runtime.program import _default_session, run_group_locally
from shardserve.runtime.thread_pools import set_threads

Span = tuple[int, int, int]  # (seq_id, start position, tokens)


class PackedModel:
    """``fused``: the ranks' composed pieces (attention in onnxruntime) serve the steps."""

    def __init__(
        self, repo: Path, servable: str, budget: int = 1 << 26, *, fused: bool = False
    ) -> None:
        self.repo = repo
        self.fused = fused
        self._composed: dict[int, ComposedRank] = {}
        self.group: GroupConfig = load_group(repo, servable, 1)
        self.caches = [
            KVCache(cache_shape(self.group, r), budget) for r in range(self.group.rank_size)
        ]
        self._sessions: dict[Path, object] = {}

    def session(self, path: Path) -> object:
        if path not in self._sessions:
            self._sessions[path] = _default_session(path)
        return self._sessions[path]

    def composed(self, rank: int) -> ComposedRank:
        if rank not in self._composed:
            files = verify_rank_files(self.repo, self.group, rank)
            stage = self.group.stage_of(rank)
            self._composed[rank] = open_pieces(stage, files, _options, run_in_thread=False)
        return self._composed[rank]

    def reserve(self, seq_id: int, capacity: int) -> None:
        for cache in self.caches:
            cache.reserve(seq_id, capacity)

    def step(
        self, spans: Sequence[Span], ids: Sequence[int], logit_rows: Sequence[int] | None = None
    ) -> np.ndarray:
        """One packed step; ``ids`` are the rows in span order; logits of ``logit_rows``
        (default every row)."""
        layout = StepLayout(spans)
        positions = np.concatenate([np.arange(s, s + n) for _, s, n in spans]).astype(np.int64)
        rows = np.arange(len(ids)) if logit_rows is None else np.asarray(logit_rows)
        inputs = {
            "input_ids": np.asarray(ids, np.int64),
            "positions": positions,
            "logit_rows": rows.astype(np.int64),
        }
        contexts = [StepAttention(cache, layout) for cache in self.caches]
        results = asyncio.run(
            run_group_locally(
                self.repo,
                self.group,
                inputs,
                self.session,
                attention=contexts,
                composed=self.composed if self.fused else None,
            )
        )
        for other in results[1:]:
            np.testing.assert_array_equal(other["logits"], results[0]["logits"])
        return results[0]["logits"]

    def generate(
        self, seq_id: int, prompt: list[int], new_tokens: int
    ) -> tuple[list[int], list[np.ndarray]]:
        """Greedy: prefill logits [T, V], then each decode step's logits [1, V]."""
        self.reserve(seq_id, len(prompt) + new_tokens)
        logits = [self.step([(seq_id, 0, len(prompt))], prompt)]
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(logits[-1][-1])))
            logits.append(self.step([(seq_id, len(tokens) - 1, 1)], tokens[-1:]))
        return tokens[len(prompt) :], logits


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    set_threads(options, 1)
    return options
