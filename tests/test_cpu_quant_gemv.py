"""quant_gemv.c: products on FP4 / FP8-block weights as stored, against an fp64 reference that decodes
the codes bit by bit here (independently of `deepinfer.accelerator.quantized_weight`).

Both the AVX2 + FMA loops and the portable C loops run on every build that has them (the portable
ones always), in the default and the `no-avx512` builds alike (the suite runs per tier).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native


@pytest.fixture(scope="module")
def lib():
    library = native.library()
    if library is None:
        pytest.skip("the cpu back end's C kernels are not available here (no C compiler, or DEEPINFER_CPU_NATIVE=0)")
    return library


def _paths(lib) -> list[bool]:
    """`portable` values to run: always the plain C loops; the AVX2 ones where they were compiled."""
    return [True, False] if native.quant_simd(lib) else [True]


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    return sign * (mantissa / 8 * 2.0 ** -6 if exponent == 0 else 2.0 ** (exponent - 7) * (1 + mantissa / 8))


def _e8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


E2M1 = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
E4M3 = torch.tensor([_e4m3(b) for b in range(256)], dtype=torch.float64)
E8M0 = torch.tensor([_e8m0(b) for b in range(256)], dtype=torch.float64)


def _fp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # low nibble first
    s = E8M0[scale.view(torch.uint8).long()] if scale.dtype == torch.float8_e8m0fnu else scale.double()
    return E2M1[codes] * s.repeat_interleave(32, dim=-1)


def _fp8_reference(data: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out, inp = data.shape
    s = E8M0[scale.view(torch.uint8).long()] if scale.dtype == torch.float8_e8m0fnu else scale.double()
    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return E4M3[data.view(torch.uint8).long()] * s


def _check(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor) -> None:
    x64 = x.double()
    want = x64 @ w64.t()
    bound = (x64.abs() @ w64.abs().t()) * 2e-6 + 1e-30  # fp32 sums of exact products
    assert y.dtype == torch.float32 and y.shape == want.shape
    assert ((y.double() - want).abs() <= bound).all(), float(((y.double() - want).abs() / bound).max())


def _fp4_weight(out: int, inp: int, seed: int, fp32_scales: bool = False) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8)  # every code, both signs
    exps = torch.randint(118, 134, (out, inp // 32), generator=g, dtype=torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)
    if fp32_scales:
        scale = torch.rand(out, inp // 32, generator=g) + 0.25
    return QuantizedWeight(data=data, scale=scale, block=128, dtype=torch.bfloat16)


def _fp8_weight(out: int, inp: int, block: int, seed: int, fp32_scales: bool = False) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (out, inp), generator=g, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x7E  # no NaN codes: weights never hold them
    blocks = (-(-out // block), -(-inp // block))
    scale = (torch.rand(blocks, generator=g) + 0.25) if fp32_scales else \
        torch.randint(115, 130, blocks, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return QuantizedWeight(data=data.view(torch.float8_e4m3fn), scale=scale, block=block, dtype=torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp4_products_match_the_bit_level_reference(lib, rows, x_dtype):
    w = _fp4_weight(70, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7)).to(x_dtype)
    for portable in _paths(lib):
        _check(native.quant_linear(lib, x, w, portable=portable), x, _fp4_reference(w.data, w.scale))


def test_fp4_with_fp32_scales_and_a_strided_x(lib):
    w = _fp4_weight(33, 64, seed=3, fp32_scales=True)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # row stride 100
    for portable in _paths(lib):
        _check(native.quant_linear(lib, x, w, portable=portable), x, _fp4_reference(w.data, w.scale))


@pytest.mark.parametrize("block, out, inp", [(128, 200, 384), (32, 45, 96), (128, 130, 200), (12, 30, 60)])
@pytest.mark.parametrize("rows", [1, 6])
def test_fp8_products_match_the_bit_level_reference(lib, block, out, inp, rows):
    # (128, 130, 200) and (12, 30, 60): ragged last blocks / a block not a multiple of 8 -> portable loop
    w = _fp8_weight(out, inp, block, seed=out + rows)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    for portable in _paths(lib):
        _check(native.quant_linear(lib, x, w, portable=portable), x, _fp8_reference(w.data, w.scale, block))


def test_fp8_subnormal_codes_and_fp32_scales(lib):
    w = _fp8_weight(64, 128, 32, seed=5, fp32_scales=True)
    w.data.view(torch.uint8)[:, :16] = torch.arange(16, dtype=torch.uint8)  # e4m3 subnormals and +-0
    w.data.view(torch.uint8)[:, 16:32] = torch.arange(128, 144, dtype=torch.uint8)
    x = torch.randn(2, 128)
    for portable in _paths(lib):
        _check(native.quant_linear(lib, x, w, portable=portable), x, _fp8_reference(w.data, w.scale, 32))


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_every_code_with_bf16_rows(lib, block):
    # bf16 rows take the AVX512-BF16 loops where built (the codes decoded to bf16): every e4m3 code,
    # subnormals and both zeros included, in blocks of 64 and of 32 codes, a strided x, 1 to 5 rows
    w = _fp8_weight(68, 256, block, seed=4)
    w.data.view(torch.uint8)[:, :] = torch.arange(256, dtype=torch.uint8).roll(3)  # every code in each row
    w.data.view(torch.uint8)[(w.data.view(torch.uint8) & 0x7F) == 0x7F] = 0x01  # no NaN codes
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for rows in (1, 2, 3, 5):
        x = wide[:rows, 20:276]
        for portable in _paths(lib):
            _check(native.quant_linear(lib, x, w, portable=portable), x, _fp8_reference(w.data, w.scale, block))


def test_bf16_results_are_the_fp32_sums_rounded_once(lib):
    for w in (_fp4_weight(36, 128, seed=6), _fp8_weight(36, 128, 32, seed=6)):
        x = torch.randn(3, 128).to(torch.bfloat16)
        for portable in _paths(lib):
            y32 = native.quant_linear(lib, x, w, portable=portable)
            assert torch.equal(native.quant_linear(lib, x, w, portable=portable, out_dtype=torch.bfloat16),
                               y32.bfloat16())


def test_a_rows_result_does_not_depend_on_the_other_rows(lib):
    w4, w8 = _fp4_weight(96, 128, seed=1), _fp8_weight(96, 128, 32, seed=2)
    x = torch.randn(7, 128)
    for w in (w4, w8):
        for portable in _paths(lib):
            batch = native.quant_linear(lib, x, w, portable=portable)
            alone = torch.cat([native.quant_linear(lib, x[i:i + 1], w, portable=portable) for i in range(7)])
            assert torch.equal(batch, alone)


def test_what_the_kernel_does_not_take_is_left_to_the_reference(lib):
    w = _fp4_weight(8, 64, seed=0)
    assert native.quant_linear(lib, torch.randn(2, 64, dtype=torch.float16), w) is None  # dtype
    assert native.quant_linear(lib, torch.randn(2, 32), w) is None  # width
    assert native.quant_linear(lib, torch.randn(2, 2, 64), w) is None  # not 2-D
    stacked = QuantizedWeight(data=w.data.expand(2, 8, 32), scale=w.scale.expand(2, 8, 2), block=128,
                              dtype=torch.bfloat16)
    assert native.quant_linear(lib, torch.randn(2, 64), stacked) is None  # experts stacked: one at a time


def test_the_cpu_back_end_runs_decode_products_on_the_codes(lib, monkeypatch):
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

    kernels = NativeCpuKernels()
    w = _fp4_weight(64, 128, seed=9)
    calls = []
    real = native.quant_linear
    monkeypatch.setattr(native, "quant_linear", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    y = kernels.linear(x, w)
    assert calls == [3] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), (x.double() @ _fp4_reference(w.data, w.scale).t()).bfloat16().double(),
                               atol=0, rtol=2 ** -7)
    most = kernels.tuning.quant_max_rows
    kernels.linear(torch.randn(most, 128, dtype=torch.bfloat16), w)  # the last size on the codes
    assert calls == [3, most]
    kernels.linear(torch.randn(most + 1, 128, dtype=torch.bfloat16), w)  # prefill-sized: the tile path
    assert calls == [3, most]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_are_the_per_group_products(lib, rows, x_dtype):
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

    kernels = NativeCpuKernels()
    kernels.__dict__["native_library"] = lib
    for parts in ([_fp8_weight(40, 256, 128, seed=g) for g in range(3)], [_fp4_weight(40, 64, seed=g) for g in range(3)]):
        w = QuantizedWeight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block,
                            torch.bfloat16)
        x = torch.randn(rows, 3, w.shape[2]).to(x_dtype)
        want = torch.stack([native.quant_linear(lib, x[:, g], parts[g], out_dtype=x_dtype) for g in range(3)], dim=1)
        assert torch.equal(native.quant_grouped_linear(lib, x, w, out_dtype=x_dtype), want)
        assert torch.equal(kernels.grouped_linear(x, w), want)  # the back end's decode path
        assert native.quant_grouped_linear(lib, x[:, :2], w) is None  # groups do not match
