"""moe_layer_quant (moe_layer.c): a decode step's MoE sub-layer in one C call with the routed experts kept
as FP4 / FP8-block codes (and the shared expert FP8, FP4, bf16 or absent), against the composed path
(the accelerator's moe_sublayer run stage by stage on the same back end: the C router top-k, dispatch,
quant_experts, combine, the shared expert's products on quant_gemv.c). The fused call runs the same
kernels in the same order; only the router's fp32 sums are a C dot product instead of torch's, so the
results agree to the bit but for a rare rounding flip. On the native, AVX2 (no-avx512) and portable
(no-avx2) builds, each where this CPU can run it.
"""
from __future__ import annotations

import pytest
import torch
from test_cpu_native import assert_close, moe_case
from test_cpu_quant_experts import _unit_experts, lib  # noqa: F401 (the per-build library fixture)
from test_cpu_quant_gemv import _fp4_weight, _fp8_weight

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def _kernels(library) -> NativeCpuKernels:
    kernels = NativeCpuKernels()
    kernels.__dict__["native_library"] = library  # this build's kernels for every stage
    return kernels


def _shared(kind: str | None, D: int, si: int, block: int):
    """The shared expert's w13 [2SI, D], w2 [D, SI] in `kind`, scaled to unit-sized products."""
    if kind is None:
        return None, None
    if kind == "bf16":
        g = torch.Generator().manual_seed(5)
        return ((torch.randn(2 * si, D, generator=g) / D ** 0.5).bfloat16(),
                (torch.randn(D, si, generator=g) / si ** 0.5).bfloat16())
    make = (lambda o, i, s: _fp4_weight(o, i, s)) if kind == "fp4" else (lambda o, i, s: _fp8_weight(o, i, block, s))
    w13, w2 = make(2 * si, D, 31), make(D, si, 32)
    shift = -6  # codes up to 6 (FP4) / 448 (FP8) times scales near 1: bring the products near unit size
    shift -= 3 if kind == "fp8" else 0

    def scaled(w: QuantizedWeight) -> QuantizedWeight:
        s = (w.scale.view(torch.uint8).int() + shift).to(torch.uint8).view(torch.float8_e8m0fnu)
        return QuantizedWeight(w.data, s, w.block, w.dtype)
    return scaled(w13), scaled(w2)


CASES = [  # (T, D, E, k, inter, shared inter, hashed, scoring, experts, shared, FP8 block)
    (1, 128, 16, 4, 64, 64, False, "sqrtsoftplus", "fp4", "fp8", 128),
    (1, 128, 8, 2, 32, 32, True, "sqrtsoftplus", "fp4", "fp4", 128),
    (3, 64, 8, 2, 32, 64, False, "sigmoid", "fp8", "fp8", 32),
    (4, 128, 16, 4, 64, 0, False, "softmax", "fp4", None, 128),
    (16, 128, 16, 4, 64, 64, False, "sqrtsoftplus", "fp4", "bf16", 128),
    (2, 64, 6, 6, 32, 32, True, "sigmoid", "fp8", "bf16", 32),
]


@pytest.mark.parametrize("T,D,E,k,inter,si,hashed,scoring,experts,shared,block", CASES)
def test_the_fused_quantised_moe_matches_the_composed_path(lib, T, D, E, k, inter, si, hashed, scoring, experts,  # noqa: F811
                                                           shared, block):
    x, gate, bias, hash_ids, *_ = moe_case(T, D, E, k, inter, max(si, 1), hashed)
    w13, _, w2, _ = _unit_experts(experts, E, D, inter, block=block)
    sw13, sw2 = _shared(shared, D, si, block)
    case = (x, gate, bias, hash_ids, w13, w2, sw13, sw2)
    args = (k, 1.5, scoring, 10.0)
    kernels = _kernels(lib)
    composed = super(NativeCpuKernels, kernels).moe_sublayer(*case, *args)
    round_silu = sw2 is not None and T * si < 4096  # the composed path's swiglu: torch's ops on a few rows
    fused = native.moe_layer_quant(lib, *case, *args, round_silu)
    assert fused is not None
    assert_close(fused, composed)
    assert (fused != composed).float().mean() <= 0.01
    # and the back end's own moe_sublayer takes the fused call (twice: packed copies from the second use)
    for _ in range(2):
        assert_close(kernels.moe_sublayer(*case, *args), composed)


def test_the_back_end_fuses_quantised_decode_batches_only(lib, monkeypatch):  # noqa: F811
    x, gate, bias, _, *_ = moe_case(2, 64, 8, 2, 32, 32, False)
    w13, _, w2, _ = _unit_experts("fp4", 8, 64, 32)
    sw13, sw2 = _shared("fp8", 64, 32, 32)
    args = (2, 1.0, "sqrtsoftplus", 10.0)
    kernels, calls, real = _kernels(lib), [], native.moe_layer_quant
    monkeypatch.setattr(native, "moe_layer_quant", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    kernels.moe_sublayer(x, gate, bias, None, w13, w2, sw13, sw2, *args)
    assert calls == [2]
    many = torch.randn(kernels.tuning.moe_fused_max_tokens + 1, 64).bfloat16()
    assert kernels.moe_sublayer(many, gate, bias, None, w13, w2, sw13, sw2, *args).shape == many.shape
    kernels.moe_sublayer(x.float(), gate, bias, None, w13, w2, sw13, sw2, *args)  # fp32: composed
    assert calls == [2]
    # what the C call does not take: the composed path
    assert real(lib, x, gate.bfloat16(), bias, None, w13, w2, sw13, sw2, *args) is None  # bf16 router
    assert real(lib, x, gate, bias, None, w13, w2, sw13, None, *args) is None  # half a shared expert
    assert real(lib, x, gate, bias, None, w13, w13, sw13, sw2, *args) is None  # w2 of w13's shape
    fp8_13, _, fp8_2, _ = _unit_experts("fp8", 8, 64, 32)
    assert real(lib, x, gate, bias, None, w13, fp8_2, sw13, sw2, *args) is None  # mixed formats
    assert real(lib, x, gate, bias, None, fp8_13, fp8_2, sw13, sw2, *args) is not None
    bad_hash = torch.full((2, 2), 8)
    assert real(lib, x, gate, None, bad_hash, w13, w2, sw13, sw2, *args) is None  # an id outside the experts
