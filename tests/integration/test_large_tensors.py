"""Tensors larger than a broker message, through a running mesh: chunked, and cut from
spliced pieces (``codec.encode_pieces``) where they are large.

Each test starts its own mesh on this module's vhost and stops it before the next one
starts: two meshes on one vhost would share one elected scheduler, and a request could be
served by the other mesh (the one not started with the small message limit).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import ModelProto

from shardserve.client import AsyncClient
from shardserve.tools.export import matmul, mlp

pytestmark = pytest.mark.integration


def unsliced(model: ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]  # type: ignore[no-any-return]


async def infer(mesh: Any, servable: str, x: np.ndarray) -> np.ndarray:
    address = mesh.http_url.removeprefix("http://")
    async with AsyncClient(address, servable, "predict", timeout=60) as client:
        (got,) = (await client.infer({"x": x})).values()
    return got


async def test_tensors_above_the_chunk_size_travel_as_chunks(
    mesh_factory: Any, export_repo: Any, tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a 4 KiB message limit every message with a tensor is chunked (48 KiB input,
    8 KiB partial sums and output), across 8 ranks whose allreduce goes through the
    stage leader: the answer is still the unsliced model's."""
    monkeypatch.setenv("SHARDSERVE_MAX_MESSAGE_BYTES", "4096")  # read by the mesh's children
    repo = export_repo(
        "matmul", tmp_path_factory.mktemp("repo"), "--rank-size", "8", "--strategy", "row"
    )
    mesh = mesh_factory(repo)
    x = np.random.default_rng(11).standard_normal((128, 96)).astype(np.float32)
    got = await infer(mesh, "matmul", x)
    assert np.max(np.abs(got - unsliced(matmul.reference_model(), {"x": x}))) <= 1e-5
    assert mesh.stop() == 0, mesh.log_tail()


async def test_megabyte_tensors_cross_stages_and_collectives_in_spliced_chunks(
    mesh_factory: Any, tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1.07 MiB request on a 4-rank, 2-stage MLP, with a 64 KiB message limit: the
    gateway sends it alone, and every message after it (the stage works, the ranks'
    collective parts, the inter-stage activation, the results, the reply) carries a
    tensor past ``codec.SPLICE_MIN_BYTES``, so each is cut into chunks from spliced
    pieces. The answer is still the unsliced model's."""
    monkeypatch.setenv("SHARDSERVE_MAX_MESSAGE_BYTES", "65536")  # read by the mesh's children
    monkeypatch.setenv("SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE", "2048")  # one job, not chunks
    shape: dict[str, Any] = dict(hidden=256, ffn=64, layers=2, seed=3)
    repo = tmp_path_factory.mktemp("repo")
    mlp.export_mlp(repo, rank_size=4, stage_size=2, **shape)
    mesh = mesh_factory(repo)
    x = np.random.default_rng(12).standard_normal((1100, 256)).astype(np.float32)
    got = await infer(mesh, "mlp", x)
    assert float(np.max(np.abs(got - unsliced(mlp.reference_model(**shape), {"x": x})))) <= 1e-5
    assert mesh.stop() == 0, mesh.log_tail()
