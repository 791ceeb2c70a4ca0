"""return_freed_memory: glibc's malloc_trim gives freed heap pages back (Linux here)."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from shardserve.heap import return_freed_memory


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
