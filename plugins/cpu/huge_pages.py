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
"""
from __future__ import annotations

import ctypes
import functools
import math
import sys

import torch

from deepinfer import envs

HUGE_PAGE = 2 << 20
# below two huge pages the alignment's slack (up to one huge page resident past the end) costs more
# than the few TLB entries saved
MIN_BYTES = 2 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def enabled() -> bool:
    """DEEPINFER_CPU_HUGE_PAGES (default on): large weight copies ask for transparent huge pages."""
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


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like `torch.empty(shape, dtype=dtype)`; if it is at least
    `MIN_BYTES`, its memory starts on a 2 MB boundary and is advised for huge pages (its storage is one
    huge page larger, so that the aligned, rounded-up range lies inside it)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    madvise = _madvise() if nbytes >= MIN_BYTES and enabled() else None
    if madvise is None:
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # advice only: pages untouched so far are then faulted in as huge pages where the kernel can
    madvise(raw.data_ptr() + start, span, _MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)
