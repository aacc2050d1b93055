"""Large CPU tensors on transparent huge pages.

A decode step streams every weight it reads from memory; at batch 1 the 129k-row LM head alone is
132 MB. On 4 KB pages such a stream crosses a page every 4 KB: the hardware prefetchers stop at each
boundary and the TLB misses once per page. On 2 MB pages neither happens, and the same product runs
1.05-1.13x faster on the development machine (the LM head's packed copy, one and two threads,
`scripts/bench_huge_pages.py`).

Linux gives a process huge pages for anonymous memory either always or only where it asks with
`madvise(MADV_HUGEPAGE)` (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the usual
default). `empty` allocates a tensor of at least `MIN_BYTES` on a 2 MB boundary and asks; where the
kernel says no (huge pages `never`, another OS, `DEEPINFER_CPU_HUGE_PAGES=0`) it is a plain
`torch.empty`. The numbers are the same either way: only the pages under them differ.

Two more places put the rest of a decode step's memory on huge pages:
- `empty` serves tensors below `MIN_BYTES` (most layers' packed copies, ~0.1-1 MB each) from a shared
  arena of 2 MB-aligned, advised chunks, so they get huge pages without a huge page of slack each;
- `collapse_process_memory`, called once the engine's weights are loaded and its cache is bound
  (`CpuAccelerator.prepare_memory`), advises every private anonymous mapping of the process (the
  malloc heap, which with `host_memory.retain_freed_memory` holds the weights, the small caches and
  the activations) and asks Linux to back its already-resident ranges with huge pages now
  (`MADV_COLLAPSE`, Linux 6.1+; older kernels leave it to khugepaged in the background).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys
import threading
import time

import torch

from deepinfer import envs

logger = logging.getLogger("deepinfer")

HUGE_PAGE = 2 << 20
# from two huge pages a tensor gets a mapping of its own; below, the alignment's slack (up to one huge
# page past the end) would cost more than the TLB entries saved, and it shares the arena's chunks
MIN_BYTES = 2 * HUGE_PAGE
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # <sys/mman.h> on Linux
# the arena's chunks (small tensors are carved from the current one, 256-byte aligned)
ARENA_CHUNK = 8 * HUGE_PAGE
_ARENA_ALIGN = 256
# a mapping is collapsed when at least this share of it is resident: the weights and the heap are;
# a large cache allocated but not yet written is not, and collapsing it would fault it all in
_COLLAPSE_MIN_RESIDENT = 0.75
# collapsing copies each 2 MB range onto a new huge page (~2 s per GB on the development machine): at most
# this much at start-up; the rest keeps the advice, and khugepaged collapses it over time
COLLAPSE_MAX_BYTES = 1 << 30


def enabled() -> bool:
    """DEEPINFER_CPU_HUGE_PAGES (default on): packed weight copies and, once the engine is built, the process's
    anonymous memory ask for transparent huge pages."""
    return envs.get_bool("DEEPINFER_CPU_HUGE_PAGES", True)


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def _advised_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` (a multiple of HUGE_PAGE) of fresh anonymous memory on a 2 MB boundary, advised for huge
    pages, as a uint8 tensor (its storage holds the mapping); None where there is no madvise."""
    madvise = _madvise()
    if madvise is None:
        return None
    # a private mapping of its own: fresh pages (heap memory may be resident on 4 KB pages already),
    # and private (a shared anonymous mapping is shmem, whose huge pages follow another setting)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                           dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # advice only: pages untouched so far are then faulted in as huge pages where the kernel can
    madvise(raw.data_ptr() + start, nbytes, _MADV_HUGEPAGE)
    return raw[start:start + nbytes]


class _Arena:
    """Small tensors carved one after the other from advised chunks of ARENA_CHUNK bytes. A chunk's
    memory is returned when the last tensor carved from it (and the arena, for the current one) is gone."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                chunk = _advised_bytes(ARENA_CHUNK)
                if chunk is None:
                    return None
                self._chunk, self._used = chunk, 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN
            return out


_ARENA = _Arena()


def empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like `torch.empty(shape, dtype=dtype)` on memory advised for
    huge pages: if it is at least `MIN_BYTES`, its own mapping, starting on a 2 MB boundary; else a
    256-byte aligned slice of the arena's current chunk. Plain `torch.empty` with `huge` False (the back
    end's `enabled()`, read once when it is made) or where the system has no madvise."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = None
    if 0 < nbytes and huge:
        raw = _ARENA.take(nbytes) if nbytes < MIN_BYTES else _advised_bytes(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    return raw[:nbytes].view(dtype).view(shape)


def _anonymous_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of this process's private, writable anonymous mappings (the heap, named
    anonymous mappings and threads' stacks included; the main thread's `[stack]` not), from /proc/self/smaps."""
    found: list[tuple[int, int, int]] = []
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields:
                continue
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
                perms, path = fields[1], fields[5] if len(fields) > 5 else ""
                anonymous = perms.startswith("rw") and perms[3] == "p" and (path in ("", "[heap]")
                                                                              or path.startswith("[anon:"))
                current = tuple(int(v, 16) for v in fields[0].split("-")) if anonymous else None
            elif current is not None and fields[0] == "Rss:":
                found.append((*current, int(fields[1]) * 1024))
                current = None
    return found


def collapse_process_memory(min_bytes: int = MIN_BYTES) -> int:
    """Advise every private anonymous mapping of this process with at least `min_bytes` of whole huge
    pages for huge pages, and collapse those mostly resident (`_COLLAPSE_MIN_RESIDENT`) onto huge pages
    now, up to COLLAPSE_MAX_BYTES in all (MADV_COLLAPSE; beyond that, or where the kernel has none, the
    advice stays for khugepaged). Returns the bytes advised; 0 where the system has no madvise or
    /proc/self/smaps. The memory's contents do not change. The caller decides whether huge pages are on
    (`enabled()`)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    try:
        mappings = _anonymous_mappings()
    except OSError:
        return 0
    advised, collapsed, t0 = 0, 0, time.perf_counter()
    for start, end, resident in mappings:
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi - lo < min_bytes or madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            continue
        advised += hi - lo
        size = min(hi - lo, COLLAPSE_MAX_BYTES - collapsed)  # whole huge pages: both are
        if resident >= _COLLAPSE_MIN_RESIDENT * (end - start) and size > 0 and madvise(lo, size, _MADV_COLLAPSE) == 0:
            collapsed += size
    logger.info("huge pages: %.0f MB of anonymous memory advised, %.0f MB collapsed in %.2f s", advised / 2**20,
                collapsed / 2**20, time.perf_counter() - t0)
    return advised
