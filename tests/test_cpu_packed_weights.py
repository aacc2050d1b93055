"""oneDNN-packed weights of the cpu back end (plugins/cpu/packed_weights.py): which weights get packed,
that a packed product equals the plain one, and that entries never outlive or mix up their weights."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from deepinfer_plugins.cpu import packed_weights
from deepinfer_plugins.cpu.accelerator import CpuAccelerator
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels
from deepinfer_plugins.cpu.packed_weights import PackedWeights

pytestmark = pytest.mark.skipif(not packed_weights.available(), reason="this torch build has no oneDNN bf16")


def bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_packed_at_the_second_use_of_the_same_weight():
    table, w = PackedWeights(), bf16(96, 64)
    assert table.lookup(w) is None and len(table) == 0  # first use: remembered, not packed
    packed = table.lookup(w)
    assert packed is not None and packed.is_mkldnn and len(table) == 1
    assert table.lookup(w) is packed  # packed once
    # a new view object each call (e.g. one expert of a stacked weight) is never packed
    stacked = bf16(4, 96, 64)
    assert all(table.lookup(stacked[1]) is None for _ in range(3)) and len(table) == 1
    assert table.peek(w) is packed and table.peek(bf16(96, 64, seed=1)) is None
    fresh = bf16(32, 64, seed=2)
    assert all(table.peek(fresh) is None for _ in range(3))  # peeking counts no use
    assert table.lookup(fresh) is None and table.peek(fresh) is None and table.lookup(fresh) is not None


def test_only_contiguous_2d_bf16_weights():
    table = PackedWeights()
    for w in (bf16(8, 16).float(), bf16(16, 8).t(), bf16(2, 8, 16)):
        assert table.lookup(w) is None and table.lookup(w) is None
    assert len(table) == 0
    # a table whose packing takes stacks of matrices (the C tiles' expert weights) packs 3-D ones too
    stacks, w = PackedWeights(pack=lambda w: w.clone(), stacks=True), bf16(2, 8, 16)
    assert stacks.lookup(w) is None and torch.equal(stacks.lookup(w), w) and len(stacks) == 1


def test_entries_go_with_their_weight_and_ids_are_checked():
    table, w = PackedWeights(), bf16(32, 32)
    table.lookup(w), table.lookup(w)
    key, ref = id(w), weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None and key not in table._entries
    # a live tensor that happens to have a recorded id (another, dead tensor's) gets no stale copy
    other = bf16(32, 32)
    table._entries[id(other)] = (weakref.ref(bf16(32, 32)), torch.ops.mkldnn._reorder_linear_weight(bf16(32, 32), 1))
    assert table.lookup(other) is None


@pytest.mark.parametrize("rows", [2, 7, 16, 40, 300])  # skinny, and bucketed GEMM row counts
def test_linear_on_packed_weights_matches_the_plain_product(rows):
    kernels, w, x = NativeCpuKernels(), bf16(200, 96), bf16(rows, 96, seed=1)
    want = F.linear(x.double(), w.double())
    for _ in range(3):  # plain, then packed twice
        got = kernels.linear(x.view(1, rows, 96), w)
        assert got.shape == (1, rows, 200) and got.dtype == torch.bfloat16
        # fp32 sums of exact bf16 products, rounded once: within one bf16 rounding of the exact value
        assert ((got.view(rows, 200).double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
    # decode batches run on the C tiles' packed copy (or, at first use, the C multi-token GEMV) instead
    low, high = kernels.tuning.packed_gemm_rows
    on_gemv = rows <= kernels.tuning.gemv_tokens_max_rows
    assert len(kernels.packed_weights) == (0 if on_gemv or low <= rows <= high else 1)


def test_one_row_and_fp32_use_the_plain_weights():
    kernels = NativeCpuKernels()
    w, w32 = bf16(64, 32), bf16(64, 32).float()
    for _ in range(3):
        kernels.linear(bf16(1, 32), w)
        kernels.linear(bf16(4, 32).float(), w32)
    assert len(kernels.packed_weights) == 0


def test_environment_switch(monkeypatch):
    """The accelerator reads the switch when it is made; its kernels then keep no packed copies."""
    monkeypatch.setenv("DEEPINFER_CPU_PACKED_WEIGHTS", "0")
    kernels, w, x = CpuAccelerator(), bf16(64, 32), bf16(4, 32)
    assert kernels.packed_weights is None and kernels.tile_weights is None and kernels.hc_weights is None
    assert NativeCpuKernels().packed_weights is not None  # the switch is the accelerator's, not a step's read
    assert torch.equal(kernels.linear(x, w), kernels.linear(x, w))
    monkeypatch.setenv("DEEPINFER_CPU_PACKED_WEIGHTS", "sometimes")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_PACKED_WEIGHTS"):
        packed_weights.available()
