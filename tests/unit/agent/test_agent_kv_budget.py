"""The KV budget rule (pure) and its inputs from /proc."""

from __future__ import annotations

from pathlib import Path

from shardserve_agent.generation.kv_budget import (
    DEFAULT_CAP_MB,
    MIB,
    SERVING_MB,
    KvBudget,
    MemoryNow,
    kv_budget,
    read_memory,
)
from shardserve_agent.settings import parse_settings

PLENTY = MemoryNow(available_bytes=64 * 1024 * MIB, data_bytes=900 * MIB)
SLICE = 100 * MIB


def test_default_is_capped_on_a_big_host() -> None:
    assert kv_budget(None, None, SLICE, PLENTY) == KvBudget(DEFAULT_CAP_MB * MIB)


def test_default_is_a_share_of_available_memory_minus_the_slice() -> None:
    memory = MemoryNow(available_bytes=1000 * MIB, data_bytes=None)
    assert kv_budget(None, None, SLICE, memory).bytes == 600 * MIB - SLICE


def test_default_under_a_memory_cap_is_half_the_room_left() -> None:
    # cap 2000 MB, 900 MB of private writable memory in use with the slice loaded, and
    # what serving adds: 1068 left
    assert SERVING_MB == 32
    assert kv_budget(None, 2000, SLICE, PLENTY).bytes == 534 * MIB


def test_without_proc_the_cap_room_is_the_cap_minus_the_slice() -> None:
    unknown = MemoryNow(available_bytes=None, data_bytes=None)
    assert kv_budget(None, 1000, SLICE, unknown).bytes == (1000 - 100 - 32) // 2 * MIB


def test_an_explicit_budget_is_kept_or_lowered_to_the_cap_room() -> None:
    assert kv_budget(300, None, SLICE, PLENTY) == KvBudget(300 * MIB)
    assert kv_budget(300, 2000, SLICE, PLENTY) == KvBudget(300 * MIB)
    assert kv_budget(5000, 2000, SLICE, PLENTY) == KvBudget(1068 * MIB, lowered_from=5000 * MIB)
    assert kv_budget(1068, 2000, SLICE, PLENTY) == KvBudget(1068 * MIB)


def test_never_negative() -> None:
    tight = MemoryNow(available_bytes=50 * MIB, data_bytes=3000 * MIB)
    assert kv_budget(None, None, SLICE, tight).bytes == 0
    assert kv_budget(100, 2000, SLICE, tight) == KvBudget(0, lowered_from=100 * MIB)


def test_read_memory_parses_proc_files(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_text("MemTotal: 4000 kB\nMemAvailable:    2048 kB\n")
    (tmp_path / "self" / "status").write_text(
        "Name: python\nVmSize:\t  4096 kB\nVmData:\t  1024 kB\n"
    )
    assert read_memory(tmp_path) == MemoryNow(2048 * 1024, 1024 * 1024)
    assert read_memory(tmp_path / "missing") == MemoryNow(None, None)


def test_read_memory_of_this_host() -> None:
    memory = read_memory()
    assert memory.available_bytes is not None and memory.available_bytes > 0
    assert memory.data_bytes is not None and memory.data_bytes > 0


def test_kv_cache_mb_option_and_variable() -> None:
    base = ["--repository", "/r", "--servable", "s", "--rank", "0"]
    assert parse_settings(base, environ={}).kv_cache_mb is None
    assert parse_settings([*base, "--kv-cache-mb", "256"], environ={}).kv_cache_mb == 256
    env = {"SHARDSERVE_AGENT_KV_CACHE_MB": "64"}
    assert parse_settings(base, environ=env).kv_cache_mb == 64
