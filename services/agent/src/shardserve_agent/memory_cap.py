"""``--max-memory-mb``: the memory an agent can write to, and what keeps that close to its data.

The cap is RLIMIT_DATA. Since Linux 4.7 it counts private writable mappings (the heap,
anonymous maps, thread stacks, libraries' data): what the agent can fill. RLIMIT_AS, the
cap before, also counted what never holds data: libraries' code (~100 MiB here),
PROT_NONE reservations (64 MiB per malloc arena, 128 MiB while one is being aligned) and
read-only file maps (the mem_opt weights). Measured on the 201 MiB TP-4 slices of
tests/integration/test_generation_capped.py: agents held 557 MiB of address space once
loaded (heap 334, code 106), and at caps of 565-580 MiB their first prefill failed with
``std::bad_alloc`` (onnxruntime, in the new executor thread that runs a step: its malloc
arena, 64 MiB aligned within a 128 MiB reservation, and its buffers no longer fit), after
which their shutdown failed too (``can't start new thread``: an 8 MiB stack). Under
RLIMIT_DATA with the set-up below the same agents load, serve and stop at 320 MiB (at
310 the load fails with exit code 1): 100 MiB before the slice, the slice, and for a
moment two thirds of the largest segment (21 MiB) while it loads.

Private writable memory still counts reservations that are only written on demand, so
a capped agent keeps them small before its slice loads (``prepare_memory``): one malloc
arena and a fixed mmap threshold while loading (shardserve.process.heap), and 2 MiB
stacks for the threads started from then on (``small_thread_stacks``): onnxruntime
opens an intra-op pool of ``--threads`` - 1 threads per segment, 13 segments at
``--threads 4`` made 312 MiB of 8 MiB stacks. Older kernels than 4.7 count only the heap
and the data segment under RLIMIT_DATA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

from shardserve.process.heap import map_large_blocks, one_arena
from shardserve_agent.settings import AgentSettings

MIB = 1024 * 1024
# Kernels in onnxruntime's pools keep small panels on the stack (MLAS: tens of KiB); the
# step thread also runs numpy and Python: 2 MiB leaves a wide margin under 8.
THREAD_STACK_BYTES = 2 * MIB
_PTHREAD_ATTR_BYTES = 64  # sizeof(pthread_attr_t) is 56 on 64-bit glibc


def prepare_memory(settings: AgentSettings) -> None:
    """Under ``--max-memory-mb``, before the slice loads: malloc set up for the cap (one
    arena, big blocks mapped alone while loading), small thread stacks, then the cap. An
    agent without a cap is left as it was: what these save is address space, not RSS."""
    if settings.max_memory_mb is None:
        return
    one_arena()
    map_large_blocks()
    small_thread_stacks()
    apply_memory_cap(settings.max_memory_mb)


def apply_memory_cap(max_memory_mb: int | None) -> None:
    """Cap the private writable memory (RLIMIT_DATA, module docstring); allocations beyond
    it then fail (MemoryError, std::bad_alloc) instead of waking the OOM killer."""
    if max_memory_mb is None:
        return
    limit = max_memory_mb * MIB
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def small_thread_stacks(stack_bytes: int = THREAD_STACK_BYTES) -> bool:
    """Threads created from now on without a stack size of their own (onnxruntime's pools,
    Python's executor) get ``stack_bytes``; True when glibc took it."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name)
    set_default = getattr(libc, "pthread_setattr_default_np", None)  # glibc >= 2.18
    if set_default is None:
        return False
    attr = ctypes.create_string_buffer(_PTHREAD_ATTR_BYTES)
    if libc.pthread_attr_init(attr) != 0:
        return False
    try:
        sized = libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(stack_bytes)) == 0
        return sized and int(set_default(attr)) == 0
    finally:
        libc.pthread_attr_destroy(attr)
