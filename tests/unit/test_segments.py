"""``shardserve.runtime.segments``: the one rule for a rank's segments, their compile-cache
identities and the weights they share -- and proof that ``shardserve warmup``, the agent
and ``shardserve.lite`` agree on it (warmup, then the agent's loader, is a cache hit for a
rank whose segments share a weight)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from twin_slices import SIZE, matmul_segment, weight, write_two_segments

from shardserve import lite
from shardserve.cli import main as cli_main
from shardserve.errors import RepositoryError, UnsafePathError
from shardserve.repo.repository import load_group, rank_checksum, rank_dir
from shardserve.runtime.segments import (
    MIN_SHARED_BYTES,
    find_shared_weights,
    rank_segments,
    segment_files,
)
from shardserve.tools.slicing import slice_pipeline
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import load_slice


@pytest.fixture(scope="module")
def twin_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_two_segments(tmp_path_factory.mktemp("twin") / "repo", "twin")


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


# ---------------------------------------------------------------- which files, which identity


def test_segments_are_the_files_the_program_runs_identified_by_their_sha256(
    twin_repo: Path,
) -> None:
    group = load_group(twin_repo, "twin", 1)
    segments = rank_segments(twin_repo, group, 0)
    assert list(segments) == ["first.onnx", "second.onnx"]
    digests = group.ranks[0].files
    assert {n: s.identity for n, s in segments.items()} == {n: digests[n] for n in segments}
    assert segments["first.onnx"].path == rank_dir(twin_repo, "twin", 1, 0) / "first.onnx"


def test_a_segment_with_external_data_is_identified_with_its_data(tmp_path: Path) -> None:
    source = tmp_path / "mm.onnx"
    onnx.save(matmul_segment("x", "y", weight(0)), source)
    slice_pipeline(source, tmp_path / "repo", stages=1, name="ext", external_threshold=16)
    group = load_group(tmp_path / "repo", "ext", 1)
    [(name, segment)] = rank_segments(tmp_path / "repo", group, 0).items()
    data = [n for n in group.ranks[0].files if n != name]
    assert data, "the slicer wrote no external data file"
    digests = group.ranks[0].files
    assert segment.identity == rank_checksum({n: digests[n] for n in (name, *data)})


def test_unlisted_external_data_and_foreign_files_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "mm.onnx"
    onnx.save(matmul_segment("x", "y", weight(0)), source)
    slice_pipeline(source, tmp_path / "repo", stages=1, name="ext", external_threshold=16)
    group = load_group(tmp_path / "repo", "ext", 1)
    folder = rank_dir(tmp_path / "repo", "ext", 1, 0)
    files = {n: folder / n for n in group.ranks[0].files}
    digests = dict(group.ranks[0].files)
    onnx_only = {n: p for n, p in files.items() if n.endswith(".onnx")}
    with pytest.raises(UnsafePathError, match="not listed"):
        segment_files(group.stage_of(0), onnx_only, digests)
    with pytest.raises(RepositoryError, match="not a file of this rank"):
        segment_files(group.stage_of(0), {}, digests)


# ---------------------------------------------------------------- shared weights


def test_a_weight_with_the_same_name_and_bytes_is_shared(twin_repo: Path) -> None:
    folder = rank_dir(twin_repo, "twin", 1, 0)
    shared = find_shared_weights({n: folder / n for n in ("first.onnx", "second.onnx")})
    assert set(shared.values) == {"W"}
    assert shared.users["W"] == ("first.onnx", "second.onnx")
    assert shared.nbytes == SIZE * SIZE * 4 >= MIN_SHARED_BYTES
    np.testing.assert_array_equal(shared.arrays["W"], weight(0))
    assert set(shared.for_segment("second.onnx")) == {"W"}


def test_same_name_other_bytes_or_one_segment_is_not_shared(tmp_path: Path) -> None:
    repo = write_two_segments(tmp_path / "repo", "pair", second_seed=1)
    folder = rank_dir(repo, "pair", 1, 0)
    segments = {n: folder / n for n in ("first.onnx", "second.onnx")}
    assert find_shared_weights(segments).values == {}
    assert find_shared_weights({"first.onnx": segments["first.onnx"]}).values == {}


# ---------------------------------------------------------------- one cache key for all


def test_warmup_then_the_agent_and_lite_hit_a_rank_with_shared_weights(
    twin_repo: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "shipped"
    # one thread throughout: a standalone run defaults to 1, warmup and agents to the cores
    warm = ["warmup", str(twin_repo), "--cache-dir", str(folder), "--threads", "1"]
    assert cli_main(warm) == 0
    settings = AgentSettings(
        repository=twin_repo, servable="twin", rank=0, cache_dir=folder, threads=1
    )
    loaded = load_slice(settings)
    assert set(loaded.shared_weights.values) == {"W"}  # the key includes the shared names
    assert loaded.cache == "hit"
    model = lite.Model()
    model.build_from_file(twin_repo / "twin" / "1", lite.Context(rank_id=0, cache_dir=folder))
    with model:
        assert model.cache_status == "hit"


def test_warmup_without_shared_weights_is_another_key(twin_repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "unshared"
    args = ["warmup", str(twin_repo), "--cache-dir", str(folder), "--no-share-weights"]
    assert cli_main(args) == 0
    sharing = AgentSettings(repository=twin_repo, servable="twin", rank=0, cache_dir=folder)
    assert load_slice(sharing).cache == "miss"
    alone = AgentSettings(
        repository=twin_repo, servable="twin", rank=0, cache_dir=folder, share_weights=False
    )
    assert load_slice(alone).cache == "hit"
