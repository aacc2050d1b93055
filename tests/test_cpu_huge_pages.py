"""The cpu back end's tensors on transparent huge pages (plugins/cpu/huge_pages.py): large ones are
2 MB-aligned and advised (the kernel marks the mapping `hg` in /proc/self/smaps), small ones are carved
from advised arena chunks, DEEPINFER_CPU_HUGE_PAGES=0 gets plain memory, the C register tiles' packed
copies use it with the same results, and the engine's builder has the process's anonymous memory
advised and collapsed once the weights and cache are in place."""
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
def test_small_tensors_share_advised_arena_chunks():
    a = huge_pages.empty((100, 100), torch.float32)
    b = huge_pages.empty((3, 7), torch.bfloat16)
    assert a.shape == (100, 100) and a.dtype is torch.float32 and b.shape == (3, 7) and b.dtype is torch.bfloat16
    assert a.data_ptr() % 256 == 0 and b.data_ptr() % 256 == 0
    assert "hg" in vm_flags(a.data_ptr()) and "hg" in vm_flags(b.data_ptr())
    # one chunk holds both (no huge page of slack each), and they do not overlap
    assert a.untyped_storage().nbytes() == huge_pages.ARENA_CHUNK + huge_pages.HUGE_PAGE
    lo, hi = sorted([(a.data_ptr(), a.numel() * 4), (b.data_ptr(), b.numel() * 2)])
    assert lo[0] + lo[1] <= hi[0] or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.fill_(1.0), b.fill_(2.0)
    assert a.sum().item() == 10_000 and b.float().sum().item() == 42
    # a tensor larger than what is left of the chunk starts a new one; the earlier ones keep theirs
    near = huge_pages.MIN_BYTES - 256
    per_chunk = huge_pages.ARENA_CHUNK // near
    parts = [huge_pages.empty((near,), torch.uint8) for _ in range(per_chunk + 1)]
    chunks = {p.untyped_storage().data_ptr() for p in parts}
    assert 2 <= len(chunks) <= 3  # the current chunk's rest first, then one full chunk and a third at most
    for i, p in enumerate(parts):
        p.fill_(i)
    assert [int(p[0]) + int(p[-1]) for p in parts] == [2 * i for i in range(len(parts))]


@linux_only
def test_the_switch_gets_plain_memory(monkeypatch):
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    monkeypatch.setenv("DEEPINFER_CPU_HUGE_PAGES", "0")
    accel = CpuAccelerator()  # reads the switch once, here
    monkeypatch.delenv("DEEPINFER_CPU_HUGE_PAGES")
    assert not accel.use_huge_pages and CpuAccelerator().use_huge_pages
    small = huge_pages.empty((100, 100), torch.float32, huge=accel.use_huge_pages)
    assert small.untyped_storage().nbytes() == 100 * 100 * 4
    plain = huge_pages.empty((2048, 2048), torch.float32, huge=accel.use_huge_pages)  # 16 MB: malloc's
    # (where it lies may be advised anyway: an engine built earlier in this process advised the heap)
    assert plain.untyped_storage().nbytes() == plain.numel() * 4
    monkeypatch.setattr(huge_pages, "collapse_process_memory", lambda: pytest.fail("collapsed with the switch off"))
    accel.prepare_memory()


@linux_only
def test_collapse_advises_resident_anonymous_memory_and_keeps_its_values():
    t = torch.empty(6 << 20, dtype=torch.uint8)  # malloc's: the heap or a mapping of its own, 4 KB pages
    t.copy_(torch.arange(t.numel()) % 251)
    before = t.clone()
    advised = huge_pages.collapse_process_memory()
    assert advised >= 4 << 20
    middle = t.data_ptr() + t.numel() // 2
    assert "hg" in vm_flags(middle)
    assert torch.equal(t, before)


def test_the_engine_builder_prepares_the_memory_once(tiny_v4, monkeypatch):
    from deepinfer import LLM, SamplingParams
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    calls = []
    monkeypatch.setattr(CpuAccelerator, "prepare_memory", lambda self: calls.append(self))
    llm = LLM(model=str(tiny_v4), accelerator="cpu", dtype="float32",
              max_model_len=32, max_num_seqs=1, async_pipeline=False)
    assert len(calls) == 1 and calls[0] is llm.engine.accelerator
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.shutdown()


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
