"""oneDNN-packed weights of the cpu back end (plugins/cpu/packed_weights.py): which weights get packed,
that a packed product equals the plain one, that a model's copies are made at load, and that entries
never outlive their weights."""
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
from deepinfer_plugins.cpu.tuning import NEVER

needs_onednn = pytest.mark.skipif(not packed_weights.available(), reason="this torch build (or its CPU: "
                                  "ONEDNN_MAX_CPU_ISA) has no oneDNN bf16, so no oneDNN copies are made")


def bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_onednn
def test_copies_are_made_when_given_and_only_then():
    table, w = PackedWeights(), bf16(96, 64)
    assert table.lookup(w) is None and len(table) == 0  # never given: none, however often it is asked
    table.add(w)
    packed = table.lookup(w)
    assert packed is not None and packed.is_mkldnn and len(table) == 1
    table.add(w)
    assert table.lookup(w) is packed and len(table) == 1  # packed once
    # a view of a weight (e.g. one expert of a stacked weight) is another object: it has no copy
    stacked = bf16(4, 96, 64)
    table.add(stacked)
    assert table.lookup(stacked[1]) is None and table.lookup(bf16(96, 64)) is None and len(table) == 1


@needs_onednn
def test_only_contiguous_2d_bf16_weights():
    table = PackedWeights()
    for w in (bf16(8, 16).float(), bf16(16, 8).t(), bf16(2, 8, 16), "not a tensor"):
        table.add(w)
    assert len(table) == 0
    # a table whose packing takes stacks of matrices (the C tiles' expert weights) packs 3-D ones too
    stacks, w = PackedWeights(pack=lambda w: w.clone(), stacks=True), bf16(2, 8, 16)
    stacks.add(w)
    assert torch.equal(stacks.lookup(w), w) and len(stacks) == 1
    # a packing function that declines a weight (None) leaves it without a copy
    declines = PackedWeights(pack=lambda w: None)
    declines.add(bf16(8, 16))
    assert len(declines) == 0


@needs_onednn
def test_entries_go_with_their_weight():
    table, w = PackedWeights(), bf16(32, 32)
    table.add(w)
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None and len(table) == 0
    assert table.lookup(bf16(32, 32)) is None  # a new tensor (perhaps at the dead one's id) has no copy


@needs_onednn
@pytest.mark.parametrize("rows", [2, 7, 16, 40, 300])  # skinny, and bucketed GEMM row counts
def test_linear_on_packed_weights_matches_the_plain_product(rows):
    kernels, w, x = NativeCpuKernels(), bf16(200, 96), bf16(rows, 96, seed=1)
    kernels.prepare_weights([("linear", w)])
    # oneDNN's copy, but where the tiles take every multi-row product (AVX2: oneDNN has no bf16 kernel there)
    assert (kernels.packed_weights.lookup(w) is not None) == (kernels.tuning.packed_gemm_rows[1] < NEVER)
    want = F.linear(x.double(), w.double())
    first = kernels.linear(x.view(1, rows, 96), w)
    assert first.shape == (1, rows, 200) and first.dtype == torch.bfloat16
    # fp32 sums of exact bf16 products, rounded once: within one bf16 rounding of the exact value
    assert ((first.view(rows, 200).double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
    # the copies exist from the start: every call takes the first call's path and bits
    assert all(torch.equal(kernels.linear(x.view(1, rows, 96), w), first) for _ in range(2))


def test_only_the_uses_a_kernel_reads_are_packed():
    """Each table copies the weights of the uses whose kernels read its copy on this build's tier."""
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build")
    w, w32, embed, fn = bf16(64, 32), bf16(64, 32).float(), bf16(64, 32, seed=1), torch.randn(24, 4 * 32)
    experts, groups = bf16(4, 64, 32, seed=2), bf16(2, 64, 32, seed=3)
    kernels.prepare_weights([("linear", w), ("linear", w32), ("embedding", embed), ("hc_pre", fn),
                             ("hc_head", torch.randn(4, 4 * 32)), ("moe_experts", experts), ("grouped_linear", groups)])
    low, high = kernels.tuning.packed_gemm_rows
    tiles, onednn, amx = kernels.tile_weights, kernels.packed_weights, kernels.native_amx
    if onednn is not None:  # w's, but where the tiles take every multi-row product (AVX2)
        assert len(onednn) == (1 if high < NEVER else 0) and onednn.lookup(w32) is None
        assert onednn.lookup(embed) is None
    assert len(tiles) == (0 if high < 1 else 1 + (not amx) + (not amx or kernels.tuning.grouped_amx_max_tokens < high))
    assert (tiles.lookup(w) is not None) == (high >= 1) and tiles.lookup(embed) is None
    assert (tiles.lookup(experts) is not None) == (high >= 1 and not amx)  # AMX's expert kernel takes those rows
    assert torch.equal(kernels.hc_weights.lookup(fn), fn.t()) and len(kernels.hc_weights) == 1


def test_a_model_packs_its_weights_at_load(tiny_v4):
    """`load_weights` gives the back end the model's weights by op: the copies exist before the first step, so
    the first request runs the path (and gives the bits) of every later one."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=str(tiny_v4), dtype="bfloat16", max_num_seqs=4)
    model, kernels = llm.engine.model, llm.engine.model.accel
    try:
        probe = bf16(8, 8)  # a linear's weight given now: the tables this build copies one into
        kernels.prepare_weights([("linear", probe)])
        for table in (kernels.packed_weights, kernels.tile_weights):
            if table is not None:  # the LM head's copies were made before any step; the embedding has none
                assert (table.lookup(model.top["head.weight"]) is not None) == (table.lookup(probe) is not None)
                assert table.lookup(model.top["embed.weight"]) is None
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 4, 3, 2, 1, 9, 8]]
        runs = [[(o.outputs[0].token_ids, [list(p.values())[0].logprob for p in o.outputs[0].logprobs])
                 for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)] for _ in range(2)]
        assert runs[0] == runs[1]
    finally:
        llm.shutdown()


def test_environment_switch(monkeypatch):
    """The accelerator reads the switch when it is made; its kernels then keep no packed copies."""
    monkeypatch.setenv("DEEPINFER_CPU_PACKED_WEIGHTS", "0")
    kernels, w, x = CpuAccelerator(), bf16(64, 32), bf16(4, 32)
    assert kernels.packed_weights is None and kernels.tile_weights is None and kernels.hc_weights is None
    kernels.prepare_weights([("linear", w)])  # nothing to make
    # the switch is the accelerator's, not a step's read
    assert NativeCpuKernels().hc_weights is not None or NativeCpuKernels().native_library is None
    assert torch.equal(kernels.linear(x, w), kernels.linear(x, w))
    monkeypatch.setenv("DEEPINFER_CPU_PACKED_WEIGHTS", "sometimes")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_PACKED_WEIGHTS"):
        packed_weights.available()
