"""return_freed_memory: glibc's malloc_trim gives freed heap pages back (Linux here);
keep_freed_memory: freed message buffers are reused without faulting their pages in."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

from shardserve.process.heap import keep_freed_memory, return_freed_memory


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc"
)
def test_freed_small_allocations_leave_the_process() -> None:
    """Many small malloc'd blocks (below the mmap threshold, so on the heap) are freed; the
    top of the heap stays pinned by one block kept alive, as after a model parse. Only the
    trim hands the freed pages back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(3000)]  # ~190 MiB
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # touch: resident
    pin = libc.malloc(64 * 1024)  # above the freed ones: free() alone cannot shrink the heap
    for block in blocks:
        libc.free(block)
    before = rss_kib()
    assert return_freed_memory() is True
    after = rss_kib()
    libc.free(pin)
    assert before - after > 100 * 1024, (before, after)


_REUSE_PROBE = """
import resource, sys
from shardserve.process.heap import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    buffers = [bytearray(1536 * 1024) for _ in range(4)]  # zeroed: every page touched
    del buffers
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(tuned, faults)
"""


def _reuse_faults(mode: str, env: dict[str, str] | None = None) -> tuple[bool, int]:
    result = subprocess.run(
        [sys.executable, "-c", _REUSE_PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    tuned, faults = result.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc"
)
def test_serving_tuning_reuses_freed_message_buffers_instead_of_faulting_them_in() -> None:
    """Four 1.5 MiB buffers alive at once, then freed, 40 times over, as a job's messages
    are: glibc's default trims the freed heap top every time (and maps the first ones
    afresh), so their pages fault in again (1,536 per round); tuned, the heap keeps them."""
    plain = _reuse_faults("plain")
    tuned = _reuse_faults("tuned")
    assert plain[0] is False and plain[1] > 30 * 1024, plain
    assert tuned[0] is True and tuned[1] < 4 * 1024, tuned


def test_a_users_own_malloc_tuning_is_left_alone() -> None:
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"}) is False
