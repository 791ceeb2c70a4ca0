"""Fidelity through the running mesh: every (rank, stage) layout of the MLP and the
transformer, served at once by one `shardserve up`, answers like the unsliced model
(fp32, max abs error <= 1e-5) — not only offline.

One mesh per model holds every layout as its own servable (41 agent processes), so the
whole grid costs one start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from shardserve.client import Client
from shardserve.tools.export import mlp, transformer

pytestmark = pytest.mark.integration

LAYOUTS = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (4, 4), (8, 4)]
MLP = dict(hidden=32, ffn=64, layers=4, seed=0)
GPT = dict(layers=4, hidden=64, heads=8, vocab=64, max_seq=16, seed=0)


def export_grid(kind: str, root: Path) -> Path:
    for rank, stage in LAYOUTS:
        name = f"{kind}_r{rank}_s{stage}"
        if kind == "mlp":
            mlp.export_mlp(root, rank_size=rank, stage_size=stage, name=name, **MLP)
        else:
            transformer.export_transformer(root, rank_size=rank, stage_size=stage, name=name, **GPT)
    return root


def unsliced(kind: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    model = mlp.reference_model(**MLP) if kind == "mlp" else transformer.reference_model(**GPT)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]  # type: ignore[no-any-return]


def sample(kind: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    if kind == "mlp":
        return {"x": rng.standard_normal((3, MLP["hidden"])).astype(np.float32)}
    return {"input_ids": rng.integers(0, GPT["vocab"], (2, 11)).astype(np.int64)}


@pytest.fixture(scope="module", params=["mlp", "transformer"])
def grid_mesh(
    request: pytest.FixtureRequest, mesh_factory: Any, tmp_path_factory: Any
) -> Iterator[tuple[str, Any]]:
    kind = request.param
    mesh = mesh_factory(export_grid(kind, tmp_path_factory.mktemp(kind)))
    yield kind, mesh
    assert mesh.stop() == 0, mesh.log_tail()


@pytest.mark.parametrize(("rank", "stage"), LAYOUTS, ids=[f"r{r}s{s}" for r, s in LAYOUTS])
def test_layout_matches_the_unsliced_model(
    grid_mesh: tuple[str, Any], rank: int, stage: int
) -> None:
    kind, mesh = grid_mesh
    feeds = sample(kind)
    address = mesh.http_url.removeprefix("http://")
    with Client(address, f"{kind}_r{rank}_s{stage}", "predict", timeout=60) as client:
        outputs = client.infer(feeds)
    (got,) = outputs.values()
    expected = unsliced(kind, feeds)
    assert got.shape == expected.shape
    assert float(np.max(np.abs(got - expected))) <= 1e-5
