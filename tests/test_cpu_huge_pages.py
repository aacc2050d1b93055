"""Large tensors of the cpu back end on transparent huge pages (plugins/cpu/huge_pages.py): the memory
is 2 MB-aligned and advised (the kernel marks the mapping `hg` in /proc/self/smaps), smaller tensors and
DEEPINFER_CPU_HUGE_PAGES=0 get plain memory, and the C register tiles' packed copies use it with the
same results."""
from __future__ import annotations

import sys

import pytest
import torch

from deepinfer_plugins.cpu import huge_pages, native

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="madvise(MADV_HUGEPAGE) and /proc/self/smaps are Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` in this process."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and ":" not in head:
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_only
def test_large_tensor_is_aligned_and_advised():
    t = huge_pages.empty((1024, 3000), torch.bfloat16)  # 5.9 MB
    assert t.shape == (1024, 3000) and t.dtype is torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr()) and "hg" in vm_flags(t.data_ptr() + t.numel() * 2 - 1)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))  # the whole range is writable
    assert t[-1, -1].item() == torch.tensor(t.numel() - 1.0).bfloat16().item()


@linux_only
def test_small_tensors_and_the_switch_get_plain_memory(monkeypatch):
    small = huge_pages.empty((100, 100), torch.float32)
    assert small.shape == (100, 100) and small.dtype is torch.float32
    assert small.untyped_storage().nbytes() == 100 * 100 * 4  # no huge-page slack below MIN_BYTES
    monkeypatch.setenv("DEEPINFER_CPU_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    plain = huge_pages.empty((2048, 2048), torch.float32)  # 16 MB: its own mmap, never advised
    assert plain.untyped_storage().nbytes() == plain.numel() * 4
    assert "hg" not in vm_flags(plain.data_ptr())


@linux_only
@pytest.mark.skipif(native.active_library() is None, reason="the cpu back end's C kernels are not built here")
def test_packed_copies_on_huge_pages_give_the_same_products():
    lib = native.active_library()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4200, 512, generator=g).bfloat16(), torch.randn(3, 512, generator=g).bfloat16()
    packed = native.pack_bf16(lib, w)
    assert packed.data_ptr() % huge_pages.HUGE_PAGE == 0 and "hg" in vm_flags(packed.data_ptr())
    plain = torch.empty(packed.shape, dtype=packed.dtype)
    plain.copy_(packed)
    out = native.packed_linear_bf16(lib, x, packed, (4200, 512))
    assert torch.equal(out, native.packed_linear_bf16(lib, x, plain, (4200, 512)))
    torch.testing.assert_close(out.float(), x.double().matmul(w.double().T).float(), rtol=2e-2, atol=2e-2)
