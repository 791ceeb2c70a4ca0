"""Agent slice loading: external data confinement, shared weights, the mem_opt cache mode,
and what the memory cap (--max-memory-mb) counts.

Loads run in-process with real onnxruntime; the refusal and the "never opens another
rank's folder" checks run real agent processes.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from twin_slices import write_two_segments

from shardserve.process.heap import map_large_blocks, one_arena
from shardserve.repo.repository import (
    RunOp,
    load_group,
    rank_checksum,
    rank_dir,
    sha256_file,
    write_group,
)
from shardserve.runtime.program import run_stage
from shardserve.tools.export.matmul import export_matmul
from shardserve.tools.slicing import slice_pipeline
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import LoadedSlice, load_slice

pytestmark = pytest.mark.integration

AGENT_SRC = Path(__file__).resolve().parents[2] / "services" / "agent" / "src"
X = np.ones((128, 96), dtype=np.float32)


class _NoCollective:
    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        raise AssertionError("these slices have no collectives")


async def _serve(loaded: LoadedSlice, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return await run_stage(loaded.stage, loaded.runners, inputs, _NoCollective())


def _agent_env(amqp_url: str = "amqp://guest:guest@127.0.0.1:1/") -> dict[str, str]:
    return {
        **os.environ,
        "SHARDSERVE_AMQP_URL": amqp_url,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(AGENT_SRC), os.environ.get("PYTHONPATH", "")]),
    }


def _settings(repo: Path, servable: str, rank: int, **over: object) -> AgentSettings:
    return AgentSettings(repository=repo, servable=servable, rank=rank, **over)  # type: ignore[arg-type]


# --- external data -----------------------------------------------------------------------


def _matmul_neg_model(path: Path) -> Path:
    w = numpy_helper.from_array(np.full((96, 16), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 16])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def external_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("external")
    model = _matmul_neg_model(tmp / "mm.onnx")
    slice_pipeline(model, tmp / "repo", stages=2, name="ext", external_threshold=16)
    return tmp / "repo"


async def test_slice_with_external_data_loads_and_serves(external_repo: Path) -> None:
    group = load_group(external_repo, "ext", 1)
    assert any(name.endswith(".data") for name in group.ranks[0].files)  # really external
    env = {"x": X}
    for rank in range(group.rank_size):
        loaded = load_slice(_settings(external_repo, "ext", rank, use_cache=False))
        # sessions only for the segments the program runs, not for the data files
        assert set(loaded.runners) == {
            op.file for op in loaded.stage.program if isinstance(op, RunOp)
        }
        env = await _serve(loaded, env)
    np.testing.assert_array_equal(env["y"], np.full((128, 16), -48.0, np.float32))


def _hostile_repo(tmp: Path, location: str) -> Path:
    """A matmul slice whose rank 0 segment points its weight at ``location`` (checksums
    updated, so only the external data check can stop it)."""
    repo = tmp / "repo"
    export_matmul(repo, rank_size=2, strategy="column", name="evil")
    group = load_group(repo, "evil", 1)
    folder = rank_dir(repo, "evil", 1, 0)
    name = next(iter(group.ranks[0].files))
    model = onnx.load(str(folder / name))
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    del weight.external_data[:]
    for key, value in (("location", location), ("offset", "0"), ("length", "3072")):
        weight.external_data.add(key=key, value=value)
    (folder / name).write_bytes(model.SerializeToString())
    files = {**group.ranks[0].files, name: sha256_file(folder / name)}
    spec = group.ranks[0].model_copy(update={"files": files, "checksum": rank_checksum(files)})
    write_group(repo / "evil" / "1", group.model_copy(update={"ranks": (spec, *group.ranks[1:])}))
    return repo


@pytest.mark.parametrize("location", ["../rank_1/x.data", "/etc/passwd"])
def test_hostile_external_data_location_refuses_to_start(tmp_path: Path, location: str) -> None:
    repo = _hostile_repo(tmp_path, location)
    done = subprocess.run(
        [sys.executable, "-m", "shardserve_agent", "--repository", str(repo)]
        + ["--servable", "evil", "--rank", "0", "--no-cache"],
        env=_agent_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert "refusing to start" in log and repr(location) in log, log
    assert "Traceback" not in log


def test_unlisted_external_data_file_is_refused(tmp_path: Path) -> None:
    """Data inside the rank folder but not in group.json would run unchecked weights."""
    repo = _hostile_repo(tmp_path, "stray.data")
    (rank_dir(repo, "evil", 1, 0) / "stray.data").write_bytes(b"\0" * 3072)
    with pytest.raises(Exception, match="not listed"):
        load_slice(_settings(repo, "evil", 0, use_cache=False))


def test_agent_never_opens_another_ranks_folder(
    external_repo: Path, amqp_url: str, tmp_path: Path
) -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: cannot watch the agent's openat calls")
    trace, log = tmp_path / "openat.txt", tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(trace), sys.executable]
            + ["-m", "shardserve_agent", "--repository", str(external_repo), "--servable"]
            + ["ext", "--rank", "1", "--cache-dir", str(tmp_path / "cache")],
            env=_agent_env(amqp_url),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "asking the scheduler" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        _stop_traced(proc)
    opened = re.findall(r'openat\([^"]*"([^"]+)"', trace.read_text())
    assert any("/rank_1/" in p for p in opened), "the trace saw no slice file at all"
    others = [p for p in opened if re.search(r"/rank_(?!1/)\d+", p)]
    assert others == []


def _stop_traced(strace: subprocess.Popen[bytes]) -> None:
    """SIGTERM the agent (strace's child), not strace, so the agent stops cleanly."""
    children = Path(f"/proc/{strace.pid}/task/{strace.pid}/children")
    pids = children.read_text().split() if children.exists() else []
    for pid in pids:
        os.kill(int(pid), signal.SIGTERM)
    try:
        strace.wait(30)
    except subprocess.TimeoutExpired:
        strace.kill()
        strace.wait(10)
        raise


# --- shared weights ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_two_segments(tmp_path_factory.mktemp("shared") / "repo", "twin")


async def test_shared_weight_is_one_array_used_by_both_sessions(shared_repo: Path) -> None:
    x = {"x": np.ones((4, 256), np.float32)}
    alone = load_slice(_settings(shared_repo, "twin", 0, use_cache=False, share_weights=False))
    shared = load_slice(_settings(shared_repo, "twin", 0, use_cache=False))
    assert alone.shared_weights.values == {}
    assert set(shared.shared_weights.values) == {"W"}
    assert shared.shared_weights.users["W"] == ("first.onnx", "second.onnx")
    expected = (await _serve(alone, x))["y"]
    np.testing.assert_allclose((await _serve(shared, x))["y"], expected, rtol=1e-5, atol=1e-6)
    # Both sessions read the one array: change it and both segments see the change.
    shared.shared_weights.arrays["W"][:] = 0.0
    assert not np.any((await _serve(shared, x))["y"])
    assert np.any((await _serve(alone, x))["y"])


async def test_shared_weights_go_through_the_compile_cache(
    shared_repo: Path, tmp_path: Path
) -> None:
    x = {"x": np.ones((4, 256), np.float32)}
    first = load_slice(_settings(shared_repo, "twin", 0, cache_dir=tmp_path))
    second = load_slice(_settings(shared_repo, "twin", 0, cache_dir=tmp_path))
    assert (first.cache, second.cache) == ("miss", "hit")
    np.testing.assert_array_equal((await _serve(first, x))["y"], (await _serve(second, x))["y"])
    second.shared_weights.arrays["W"][:] = 0.0  # the cached graph still takes W from outside
    assert not np.any((await _serve(second, x))["y"])


# --- mem_opt cache mode --------------------------------------------------------------------


async def test_mem_opt_second_start_hits_and_answers_the_same(
    shared_repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = {"x": np.ones((4, 256), np.float32)}
    settings = _settings(
        shared_repo, "twin", 0, cache_dir=tmp_path, cache_mode="mem_opt", share_weights=False
    )
    reference = load_slice(_settings(shared_repo, "twin", 0, use_cache=False))
    with caplog.at_level(logging.INFO):
        first = load_slice(settings)
    assert first.cache == "miss"
    assert "no artefact for first.onnx; loaded it the regular way" in caplog.text
    entries = sorted(tmp_path.glob("*.mem_opt"))  # noqa: ASYNC240 (a test's temp folder)
    assert len(entries) == 2
    assert all((e / "model.onnx.data").stat().st_size >= 256 * 256 * 4 for e in entries)
    caplog.clear()
    second = load_slice(settings)
    assert second.cache == "hit" and "regular way" not in caplog.text
    want = (await _serve(reference, x))["y"]
    for loaded in (first, second):
        np.testing.assert_allclose((await _serve(loaded, x))["y"], want, rtol=1e-5, atol=1e-6)


async def test_mem_opt_missing_artefact_falls_back_and_is_rewritten(
    shared_repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(shared_repo, "twin", 0, cache_dir=tmp_path, cache_mode="mem_opt")
    load_slice(settings)
    for entry in tmp_path.glob("*.mem_opt"):  # noqa: ASYNC240 (a test's temp folder)
        shutil.rmtree(entry)
    with caplog.at_level(logging.INFO):
        again = load_slice(settings)
    assert again.cache == "miss"
    assert "compile cache (mem_opt) has no artefact" in caplog.text
    assert load_slice(settings).cache == "hit"


def test_mem_opt_and_standard_keep_separate_entries(shared_repo: Path, tmp_path: Path) -> None:
    load_slice(_settings(shared_repo, "twin", 0, cache_dir=tmp_path))
    mem_opt = load_slice(
        _settings(shared_repo, "twin", 0, cache_dir=tmp_path, cache_mode="mem_opt")
    )
    assert mem_opt.cache == "miss"  # the mode is part of the key


# --- the memory cap (--max-memory-mb) ------------------------------------------------------

_CAP_PROBE = """
import mmap, sys
from shardserve_agent.memory_cap import apply_memory_cap
def data_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) // 1024
apply_memory_cap(data_mib() + 64)
# 1 GiB reserved, never writable: the cap does not count it (RLIMIT_AS would).
reserved = mmap.mmap(-1, 1 << 30, prot=0)  # PROT_NONE
try:
    bytearray(128 << 20)  # written memory beyond the cap
except MemoryError:
    print("refused")
else:
    print("allowed")
"""


def test_the_cap_counts_written_memory_not_reservations() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CAP_PROBE], env=_agent_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused"]


_STACK_PROBE = """
import sys, threading
from pathlib import Path
from shardserve_agent.memory_cap import prepare_memory
from shardserve_agent.settings import AgentSettings
def data_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1])
cap = None if sys.argv[1] == "none" else 4096
prepare_memory(AgentSettings(repository=Path("/r"), servable="s", rank=0, max_memory_mb=cap))
release = threading.Event()
before = data_kib()
threads = [threading.Thread(target=release.wait) for _ in range(16)]
for thread in threads:
    thread.start()
per_thread = (data_kib() - before) / len(threads) / 1024
release.set()
for thread in threads:
    thread.join()
print(round(per_thread, 1))
"""


def _stack_mib_per_thread(cap: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _STACK_PROBE, cap],
        env=_agent_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_under_a_cap_new_threads_cost_2_mib_of_it_instead_of_8() -> None:
    """A thread's stack counts whole under the cap; onnxruntime starts --threads - 1 of them
    per segment, so a capped agent gives new threads small stacks (memory_cap)."""
    capped, uncapped = _stack_mib_per_thread("4096"), _stack_mib_per_thread("none")
    assert 1.9 <= capped <= 2.5, capped
    assert uncapped >= 7.0, uncapped  # (a thread that ended earlier may leave its stack cached)


_LOAD_PROBE = """
import ctypes, sys
from shardserve.process.heap import map_large_blocks, return_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def data_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) // 1024
tuned = map_large_blocks() if sys.argv[1] == "tuned" else False
libc.free(libc.malloc(3 << 20))  # as a first parse buffer freed: glibc's threshold rises
before = data_mib()
buffers = [libc.malloc(3 << 20) for _ in range(40)]  # the next segments' parse buffers
kept = libc.malloc(64 << 10)  # a weight allocated after them, alive while serving
for buffer in buffers:
    libc.free(buffer)
return_freed_memory()
print(tuned, data_mib() - before)
"""


def _data_kept_after_a_load(mode: str) -> tuple[bool, int]:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, mode], env=_agent_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    tuned, kept_mib = done.stdout.split()
    return tuned == "True", int(kept_mib)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_parse_buffers_leave_the_capped_memory_whole() -> None:
    """120 MiB of 3 MiB buffers freed below a live block: on glibc's heap (its threshold rose)
    they keep counting under the cap even trimmed; mapped alone they are gone."""
    tuned, kept = _data_kept_after_a_load("plain")
    assert not tuned and 110 <= kept <= 130, kept
    tuned, kept = _data_kept_after_a_load("tuned")
    assert tuned and kept < 8, kept


def test_a_users_own_malloc_tuning_wins_over_the_caps_set_up() -> None:
    assert one_arena({"MALLOC_ARENA_MAX": "4"}) is False
    assert one_arena({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) is False
    assert map_large_blocks({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert map_large_blocks({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
