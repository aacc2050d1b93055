"""quant_experts.c: every routed expert of a step on FP4 / FP8-block codes in one call, against an fp64
reference built from the bit-level decoders of test_cpu_quant_gemv (independent of
`deepinfer.accelerator.quantized_weight`).

Each build runs its vector loops (AVX512-BF16 for FP4 with bf16 rows, AVX2 + FMA otherwise, where
compiled) and its portable C loops: the library built for this CPU, and, where it has what they
switch off, the `no-avx512` build (the AVX2 tier) and the `no-avx2` build (plain C only), compiled
into a temporary folder (the suite's own `no-avx512` run has the former as its library).
"""
from __future__ import annotations

import pytest
import torch
from test_cpu_quant_gemv import _fp4_reference, _fp4_weight, _fp8_reference, _fp8_weight, _paths

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native

LIMIT = 10.0


# a switched build runs where the library has what the switch removes (else the library is that build)
_SWITCH_REMOVES = {"no-avx512": "avx512f", "no-avx2": "avx2"}


# the switch builds compile a library of their own: slow
@pytest.fixture(scope="module", params=["native", pytest.param("no-avx512", marks=pytest.mark.slow),
                                        pytest.param("no-avx2", marks=pytest.mark.slow)])
def lib(request, tmp_path_factory, once_compiler):
    library = native.library()
    if library is None:
        pytest.skip("the cpu back end's C kernels are not available here (no C compiler, or DEEPINFER_CPU_NATIVE=0)")
    if request.param == "native":
        return library
    if _SWITCH_REMOVES[request.param] not in native.build_isa(library):
        pytest.skip(f"the library is already built without {_SWITCH_REMOVES[request.param]} (this CPU or "
                    f"DEEPINFER_CPU_NATIVE_ISA): the 'native' case runs that tier")
    path = tmp_path_factory.mktemp(request.param) / "kernels.so"
    native._compile(path, once_compiler, native.build_flags(request.param))
    return native._load(path)


def _stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    return QuantizedWeight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                           parts[0].block, torch.bfloat16)


def _experts(kind: str, E: int, D: int, inter: int, fp32_scales: bool = False, block: int = 32):
    """w13 [E, 2I, D], w2 [E, D, I] and their fp64 values; scales chosen so that gate/up reach the clamp"""
    if kind == "fp4":
        make = lambda out, inp, seed: _fp4_weight(out, inp, seed, fp32_scales)  # noqa: E731
        value = lambda w: _fp4_reference(w.data, w.scale)  # noqa: E731
    else:
        make = lambda out, inp, seed: _fp8_weight(out, inp, block, seed, fp32_scales)  # noqa: E731
        value = lambda w: _fp8_reference(w.data, w.scale, block)  # noqa: E731
    w13 = [make(2 * inter, D, 100 + e) for e in range(E)]
    w2 = [make(D, inter, 200 + e) for e in range(E)]
    w13_64 = torch.stack([value(w) for w in w13])
    w2_64 = torch.stack([value(w) for w in w2])
    # unit-sized products: divide by the typical sum so that the clamp at 10 is sometimes reached
    s13, s2 = 2.0 / w13_64.abs().mean() / D ** 0.5, 1.0 / w2_64.abs().mean() / inter ** 0.5
    return _stack(w13), _stack(w2), w13_64, w2_64, float(s13), float(s2)


def _reference(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor):
    """fp64 expert outputs and the abs-sums that bound their rounding errors"""
    x64, inter = x.double(), w2.shape[2]
    out, bound, start = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64), torch.zeros(x.shape[0], w2.shape[1],
                                                                                              dtype=torch.float64), 0
    for e, c in enumerate(counts):
        rows = x64[start:start + c]
        gu = rows @ w13[e].t()
        g, u = gu[:, :inter].clamp(max=LIMIT), gu[:, inter:].clamp(-LIMIT, LIMIT)
        h = g * torch.sigmoid(g) * u
        # |h|'s own error: the gate/up sums' (relative to their abs-sums) times the slopes, plus h's
        gu_abs = rows.abs() @ w13[e].abs().t()
        h_err = (gu_abs[:, :inter] * 1.1 * u.abs() + gu_abs[:, inter:] * (g * torch.sigmoid(g)).abs() + h.abs())
        out[start:start + c] = h @ w2[e].t()
        bound[start:start + c] = (h.abs() + h_err) @ w2[e].abs().t()
        start += c
    return out, bound


def _scaled(w: QuantizedWeight, w64: torch.Tensor, factor: float) -> tuple[QuantizedWeight, torch.Tensor]:
    """the weight with its scales times a power of two (exact in both scale formats)"""
    shift = round(torch.tensor(factor).log2().item())
    if w.scale.dtype == torch.float8_e8m0fnu:
        scale = (w.scale.view(torch.uint8).int() + shift).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = w.scale * 2.0 ** shift
    return QuantizedWeight(w.data, scale, w.block, w.dtype), w64 * 2.0 ** shift


def _unit_experts(kind: str, E: int, D: int, inter: int, fp32_scales: bool = False, block: int = 32):
    w13, w2, w13_64, w2_64, s13, s2 = _experts(kind, E, D, inter, fp32_scales, block)
    return (*_scaled(w13, w13_64, s13), *_scaled(w2, w2_64, s2))


def _check(lib, kind: str, counts: list[int], dtype: torch.dtype, fp32_scales: bool = False, block: int = 32,
           D: int = 64, inter: int = 32):
    w13, w13_64, w2, w2_64 = _unit_experts(kind, len(counts), D, inter, fp32_scales, block)
    n = sum(counts)
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(n)).to(dtype)
    want, bound = _reference(x, counts, w13_64, w2_64)
    # fp32: sums of exact products (~1e-6 relative to the abs-sums); bf16: gate/up, the hidden rows
    # and the output each rounded to 8 bits
    tol = 2e-5 if dtype == torch.float32 else 2 ** -6
    for portable in _paths(lib):
        y = native.quant_experts(lib, x, torch.tensor(counts), w13, w2, LIMIT, portable=portable)
        assert y.dtype == dtype and y.shape == (n, D)
        err = (y.double() - want).abs()
        assert (err <= tol * bound + 1e-30).all(), (portable, float((err / bound).max()))


@pytest.mark.parametrize("counts", [[2, 0, 3, 1, 0], [0, 0, 7, 0, 0], [1, 1, 1, 1, 1], [5, 0, 0, 0, 9]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_experts_match_the_bit_level_reference(lib, counts, dtype):
    _check(lib, "fp4", counts, dtype)


@pytest.mark.parametrize("block, D, inter", [(32, 64, 32), (128, 256, 64), (12, 48, 30)])
def test_fp8_experts_match_the_bit_level_reference(lib, block, D, inter):
    # (128, 256, 64): gate and up rows share a scale block; (12, 48, 30): blocks the AVX2 loop does not take
    _check(lib, "fp8", [3, 0, 1], torch.bfloat16, block=block, D=D, inter=inter)
    _check(lib, "fp8", [0, 4, 0], torch.float32, block=block, D=D, inter=inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_scales(lib, dtype):
    # bf16 rows on AVX512-BF16: the scales applied by one FMA per group instead of added to the exponents
    _check(lib, "fp4", [2, 3, 0], dtype, fp32_scales=True)
    _check(lib, "fp8", [2, 3, 0], dtype, fp32_scales=True)


def test_fp4_scales_outside_the_exponent_range(lib):
    # every scale of some output rows 2^-127 (0.5 x 2^-127 is no normal bf16): their 4-row tiles apply
    # the scales by FMA, the other tiles add them to the exponents; both against the reference, to
    # the relative bound also where the values are ~1e-38
    w13, w13_64, w2, w2_64 = _unit_experts("fp4", 2, 64, 32)
    for w, w64 in ((w13, w13_64), (w2, w2_64)):
        w.scale.view(torch.uint8)[:, ::8] = 0
        w64.copy_(torch.stack([_fp4_reference(w.data[e], w.scale[e]) for e in range(2)]))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    want, bound = _reference(x, [2, 3], w13_64, w2_64)
    for portable in _paths(lib):
        y = native.quant_experts(lib, x, torch.tensor([2, 3]), w13, w2, LIMIT, portable=portable)
        assert ((y.double() - want).abs() <= 2 ** -6 * bound).all()


def test_a_rows_result_does_not_depend_on_the_other_rows(lib):
    w13, _, w2, _ = _unit_experts("fp4", 2, 64, 32)
    x = torch.randn(7, 64).bfloat16()
    for portable in _paths(lib):
        batch = native.quant_experts(lib, x, torch.tensor([0, 7]), w13, w2, LIMIT, portable=portable)
        alone = torch.cat([native.quant_experts(lib, x[i:i + 1], torch.tensor([0, 1]), w13, w2, LIMIT,
                                                portable=portable) for i in range(7)])
        assert torch.equal(batch, alone)


def test_what_the_kernel_does_not_take_is_left_to_the_reference(lib):
    w13, w2, *_ = _experts("fp4", 3, 64, 32)
    f13, f2, *_ = _experts("fp8", 3, 64, 32)
    x, counts = torch.randn(4, 64), torch.tensor([1, 2, 1])
    assert native.quant_experts(lib, x, torch.tensor([1, 2, 2]), w13, w2, LIMIT) is None  # counts do not add up
    assert native.quant_experts(lib, x, torch.tensor([5, -1, 0]), w13, w2, LIMIT) is None  # negative count
    assert native.quant_experts(lib, x.half(), counts, w13, w2, LIMIT) is None  # dtype
    assert native.quant_experts(lib, x[:, :32], counts, w13, w2, LIMIT) is None  # width
    assert native.quant_experts(lib, x, counts, w13, f2, LIMIT) is None  # mixed formats
    assert native.quant_experts(lib, x, counts, w13.dequantize(), w2, LIMIT) is None  # not quantised
    assert native.quant_experts(lib, x[:0], torch.zeros(3, dtype=torch.long), w13, w2, LIMIT).shape == (0, 64)


def test_the_cpu_back_end_runs_decode_experts_in_one_call(monkeypatch):
    from deepinfer_plugins.cpu.kernels import CpuKernels
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.skip("the cpu back end's C kernels are not available here")
    most = kernels.tuning.quant_max_rows
    w13, _, w2, _ = _unit_experts("fp4", 4, 64, 32)
    calls = []
    real = native.quant_experts
    monkeypatch.setattr(native, "quant_experts", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))

    def run(counts: list[int]) -> torch.Tensor:
        n = sum(counts)
        rows = torch.randn(n, 64, generator=torch.Generator().manual_seed(n)).bfloat16()
        plan = MoEDispatch(tokens_per_expert=torch.tensor(counts), source_token=torch.arange(n),
                           source_slot=torch.zeros(n, dtype=torch.long), num_tokens=n)
        y = kernels.moe_experts(rows, plan, w13, w2, LIMIT)
        per_expert = CpuKernels.quantized_experts(kernels, rows, plan, w13, w2, LIMIT)
        # the same products; roundings to bf16 of nearly equal sums may differ by one step
        torch.testing.assert_close(y.float(), per_expert.float(), atol=2 ** -6 * float(per_expert.abs().max()),
                                   rtol=2 ** -6)
        return y

    run([1, 0, 2, 1])
    assert calls == [4]
    run([most, 3, 0, 1])  # the largest expert on the codes
    assert calls == [4, most + 4]
    run([most + 1, 0, 0, 0])  # prefill-sized: one expert at a time (dequantised tiles)
    assert calls == [4, most + 4]
    kernels.set_batch_invariant(True)  # its fixed-order products, one expert at a time
    run([1, 0, 2, 1])
    assert calls == [4, most + 4]
