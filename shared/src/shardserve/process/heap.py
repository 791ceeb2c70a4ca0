"""The C heap: give free pages back after loading a slice, keep them while serving.

Building an onnxruntime session parses the model's protobuf and copies every initializer
into its own buffers; glibc keeps the freed parse buffers in the process (tens of MB for
a 64 MB slice: measured 168 -> 121 MB RSS for the benchmark MLP). ``malloc_trim(0)``
returns them (``return_freed_memory``).

Serving is the opposite case: every job allocates and frees message buffers of 0.1-8 MB
(bodies, stacked inputs, packed messages). glibc serves those from fresh mmaps (its
threshold starts at 128 KiB) or trims them off the heap top, so every page of every new
buffer is faulted in again: 23 page faults per request in the scheduler and 13 in the
agent at rank-1 binary c32, 10-15 % of their CPU in this VM. ``keep_freed_memory`` makes
such buffers heap memory that is reused, and bounds what the heap top may keep.

Loading under a memory cap (the agent's ``--max-memory-mb``, RLIMIT_DATA) is a third
case: what counts is the heap's extent, not its resident pages. glibc's dynamic mmap
threshold rises to the size of the first big block freed, so the parse buffers and
initializer copies of later segments land on the heap, and the freed ones leave holes
that ``malloc_trim`` makes non-resident but that still count: 360 MiB of heap for a 200
MiB slice (measured, TP 4 shard of a 790 MiB Llama). ``map_large_blocks`` gives every
block of 1 MiB or more its own mapping while a slice loads, returned whole when freed
(341 instead of 477 MiB of private writable memory after that load), and ``one_arena``
keeps every thread on the main heap, so a thread that starts later (the executor's, for
a step) does not hold a 64 MiB arena of its own whose high-water mark counts too.
Elsewhere than glibc all of these do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

_logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h) and the values serving uses.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
MMAP_THRESHOLD = 32 * 1024 * 1024  # bigger blocks (64 MB activations) still get their own map
TRIM_THRESHOLD = 64 * 1024 * 1024  # free memory the heap top may keep
TOP_PAD = 16 * 1024 * 1024  # headroom per heap extension (address space; RSS once touched)
LOAD_MMAP_THRESHOLD = 1024 * 1024  # while loading: big blocks mapped alone, unmapped when freed
# Environment variables through which a user already tunes glibc's malloc: left alone.
_USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def return_freed_memory() -> bool:
    """Trim the C heap; True when glibc's ``malloc_trim`` ran."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)  # musl, macOS: no malloc_trim
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    _logger.debug("returned freed heap memory to the system")
    return True


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Tune glibc's malloc for serving (above); True when it was tuned. A user's own
    malloc tuning (``GLIBC_TUNABLES`` with glibc.malloc, ``MALLOC_*_``) wins."""
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return _tune(settings, environ)


def map_large_blocks(environ: Mapping[str, str] | None = None) -> bool:
    """Before a slice loads: blocks of ``LOAD_MMAP_THRESHOLD`` or more get their own
    mapping, so freed parse buffers leave the process whole (above); True when tuned.
    ``keep_freed_memory`` sets the serving threshold afterwards."""
    return _tune(((_M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD),), environ)


def one_arena(environ: Mapping[str, str] | None = None) -> bool:
    """Before any thread allocates: every thread uses the main heap (above); True when
    tuned. Must run before the threads it should cover first call malloc. A user's
    ``MALLOC_ARENA_MAX`` wins too."""
    if "MALLOC_ARENA_MAX" in (os.environ if environ is None else environ):
        return False
    return _tune(((_M_ARENA_MAX, 1),), environ)


def _tune(settings: tuple[tuple[int, int], ...], environ: Mapping[str, str] | None) -> bool:
    """``mallopt`` each (parameter, value); False when the user tunes malloc or this is
    not glibc."""
    env = os.environ if environ is None else environ
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k in env for k in _USER_TUNING):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings)
