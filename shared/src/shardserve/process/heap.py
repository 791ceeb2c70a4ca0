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
Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

_logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h) and the values serving uses.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # bigger blocks (64 MB activations) still get their own map
TRIM_THRESHOLD = 64 * 1024 * 1024  # free memory the heap top may keep
TOP_PAD = 16 * 1024 * 1024  # headroom per heap extension (address space; RSS once touched)
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
    env = os.environ if environ is None else environ
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k in env for k in _USER_TUNING):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
