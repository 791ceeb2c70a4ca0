"""The per-rank compile cache: keys, hits, corrupt entries, unwritable folders, and the
memory a cold start keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from shardserve.repo.repository import load_group, verify_rank_files
from shardserve.runtime.compile_cache import (
    CACHE_MODES,
    CompileCache,
    SessionConfig,
    cache_key,
    cpu_features,
)
from shardserve.runtime.thread_pools import NO_SPINNING
from shardserve.tools.export.matmul import export_matmul

BASE = dict(
    slice_sha256="a" * 64,
    rank=0,
    config=SessionConfig(intra_op_threads=1),
    ort_version="1.20.0",
    cpu="avx avx2 sse4_2",
)


@pytest.fixture(scope="module")
def segment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo = tmp_path_factory.mktemp("repo")
    export_matmul(repo, rank_size=1)
    group = load_group(repo, "matmul", 1)
    name, path = next(iter(verify_rank_files(repo, group, 0).items()))
    return path, group.ranks[0].files[name]


def _run(session: object) -> np.ndarray:
    x = np.ones((128, 96), dtype=np.float32)
    return session.run(None, {"x": x})[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "change",
    [
        {"slice_sha256": "b" * 64},
        {"rank": 1},
        {"config": SessionConfig(intra_op_threads=2)},
        {"config": SessionConfig(inter_op_threads=2)},
        {"ort_version": "1.21.0"},
        {"cpu": "avx sse4_2"},
        {"opt_level": "ORT_ENABLE_EXTENDED"},
    ],
)
def test_every_ingredient_changes_the_key(change: dict[str, object]) -> None:
    assert cache_key(**{**BASE, **change}) != cache_key(**BASE)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_sessions_get_their_thread_count_and_workers_that_never_spin(mode: str) -> None:
    options = SessionConfig(intra_op_threads=3, mode=mode).options(optimize=True)  # type: ignore[arg-type]
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 1)
    assert [options.get_session_config_entry(key) for key, _ in NO_SPINNING] == ["0", "0"]
    assert not options.enable_cpu_mem_arena  # one arena per session kept each one's peak


def test_key_is_stable() -> None:
    assert cache_key(**BASE) == cache_key(**BASE)  # type: ignore[arg-type]


def test_cpu_features_reads_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : sse avx2 avx\n\nprocessor : 1\nflags : x\n")
    assert cpu_features(info) == "avx avx2 sse"


def test_miss_then_hit_gives_same_answers(tmp_path: Path, segment: tuple[Path, str]) -> None:
    path, sha = segment
    first, status1 = CompileCache(tmp_path, 0, SessionConfig()).open(path, sha)
    second, status2 = CompileCache(tmp_path, 0, SessionConfig()).open(path, sha)
    assert (status1, status2) == ("miss", "hit")
    np.testing.assert_array_equal(_run(first), _run(second))
    assert float(_run(second)[0, 0]) == -48.0
    entries = sorted(p.suffix for p in tmp_path.iterdir())
    assert entries == [".json", ".onnx"]  # no temp files left behind


def test_ranks_sharing_a_folder_keep_their_own_entries(
    tmp_path: Path, segment: tuple[Path, str]
) -> None:
    path, sha = segment
    CompileCache(tmp_path, 0, SessionConfig()).open(path, sha)
    _, status = CompileCache(tmp_path, 1, SessionConfig()).open(path, sha)
    assert status == "miss"
    assert len(list(tmp_path.glob("*.onnx"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage_sidecar", "bytes_flipped"])
def test_corrupt_entry_is_rebuilt(tmp_path: Path, segment: tuple[Path, str], damage: str) -> None:
    path, sha = segment
    cache = CompileCache(tmp_path, 0, SessionConfig())
    cache.open(path, sha)
    key = cache.key_for(sha)
    artefact, sidecar = tmp_path / f"{key}.onnx", tmp_path / f"{key}.json"
    if damage == "truncate":
        artefact.write_bytes(artefact.read_bytes()[:50])
    elif damage == "garbage_sidecar":
        sidecar.write_text("{not json")
    else:
        data = bytearray(artefact.read_bytes())
        data[-1] ^= 0xFF
        artefact.write_bytes(bytes(data))
    session, status = CompileCache(tmp_path, 0, SessionConfig()).open(path, sha)
    assert status == "miss"
    assert float(_run(session)[0, 0]) == -48.0
    assert json.loads(sidecar.read_text())["key"] == key
    assert CompileCache(tmp_path, 0, SessionConfig()).open(path, sha)[1] == "hit"


def test_artefact_that_fails_to_load_is_rebuilt(tmp_path: Path, segment: tuple[Path, str]) -> None:
    """A sidecar that matches a broken artefact (written by a buggy run) still rebuilds."""
    path, sha = segment
    cache = CompileCache(tmp_path, 0, SessionConfig())
    key = cache.key_for(sha)
    bad = tmp_path / f"{key}.onnx"
    bad.write_bytes(b"not an onnx model")
    import hashlib

    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    (tmp_path / f"{key}.json").write_text(json.dumps({"key": key, "sha256": digest}))
    session, status = cache.open(path, sha)
    assert status == "miss"
    assert float(_run(session)[0, 0]) == -48.0


def test_unwritable_folder_runs_without_cache(tmp_path: Path, segment: tuple[Path, str]) -> None:
    path, sha = segment
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = CompileCache(blocker / "cache", 0, SessionConfig())  # cannot mkdir under a file
    session, status = cache.open(path, sha)
    assert not cache.enabled and status == "off"
    assert float(_run(session)[0, 0]) == -48.0


def test_disabled_cache_is_off(tmp_path: Path, segment: tuple[Path, str]) -> None:
    path, sha = segment
    session, status = CompileCache(None, 0, SessionConfig()).open(path, sha)
    assert status == "off"
    assert float(_run(session)[0, 0]) == -48.0


_OPEN_PROBE = """
import sys
from pathlib import Path
from shardserve.runtime.compile_cache import CompileCache, SessionConfig
from shardserve.process.heap import return_freed_memory
cache = CompileCache(Path(sys.argv[2]), 0, SessionConfig(mode=sys.argv[3]))
session, status = cache.open(Path(sys.argv[1]), "f" * 64)
return_freed_memory()  # as the agent does after loading its slice
anon = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
print(status, anon // 1024)
"""


def _open_in_process(model: Path, folder: Path, mode: str) -> tuple[str, int]:
    """(cache status, RssAnon MB) of a fresh process that opened ``model`` via the cache."""
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_PROBE, str(model), str(folder), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    status, anon_mb = result.stdout.split()
    return status, int(anon_mb)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("mode", ["standard", "mem_opt"])
def test_a_cold_start_holds_no_more_memory_than_a_warm_one(tmp_path: Path, mode: str) -> None:
    """The session that writes the entry kept a second copy of every weight (+48 MB here);
    a miss serves from the entry just written, as a hit does."""
    weight = np.random.default_rng(0).standard_normal((3072, 4096), dtype=np.float32)  # 48 MB
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3072])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4096])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    model = tmp_path / "big.onnx"
    onnx.save(onnx.helper.make_model(graph), model)
    cold_status, cold_mb = _open_in_process(model, tmp_path / "cache", mode)
    warm_status, warm_mb = _open_in_process(model, tmp_path / "cache", mode)
    assert (cold_status, warm_status) == ("miss", "hit")
    assert cold_mb - warm_mb < 16, (cold_mb, warm_mb)
