"""DeepSeek-V4.1 cache precision formats: bit-exact against the released QAT reference."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v41 import kv_quant as kq
from deepinfer.models.deepseek_v41.kv_quant import (FORMATS, FP8_WINDOW, MXFP4_INDEX,
                                                    NVFP4_COMPRESSED, KVFormat, decode, encode,
                                                    fake_quantize)

ALL = (FP8_WINDOW, NVFP4_COMPRESSED, MXFP4_INDEX)
IDS = [f.name for f in ALL]
DTYPES = (torch.float32, torch.bfloat16)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _oracle():
    mod = pytest.importorskip(
        "nemo_automodel.components.models.deepseek_v41.quantization",
        reason="reference nemo_automodel deepseek_v41 quantization is not installed")
    return mod.quantize_cache


def _ref(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    return _oracle()(x, format=fmt.name, block_size=fmt.block)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so equality is bit-for-bit (signed zeros and all)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16,
                                torch.float16: torch.int16}[t.dtype])


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (_bits(a) != _bits(b))
    if diff.any():
        i = diff.nonzero()[0].tolist()
        raise AssertionError(f"{int(diff.sum())} mismatching elements, first at {i}: "
                             f"{a[tuple(i)].item()!r} vs {b[tuple(i)].item()!r}")


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    cases = {}
    for scale in (1e-6, 1.0, 1e3):
        cases[f"normal{scale:g}"] = (torch.randn(7, 512, generator=g) * scale).to(dtype)
    cases["zeros"] = torch.zeros(3, 128, dtype=dtype)
    cases["neg_zeros"] = -torch.zeros(2, 64, dtype=dtype)
    cases["negative"] = (-torch.rand(4, 96, generator=g) * 10).to(dtype)
    cases["partial"] = (torch.randn(5, 3, 77, generator=g) * 3).to(dtype)       # 77 % 16, % 32 != 0
    cases["odd_partial"] = (torch.randn(6, 9, generator=g)).to(dtype)            # odd, < one block
    mixed = torch.randn(4, 256, generator=g)
    mixed[:, ::3] *= 1e-5
    mixed[0, :32] = 0.0
    mixed[1, 32:64] = 1e-9   # below every scale floor
    cases["mixed"] = mixed.to(dtype)
    cases["fp8_edges"] = torch.tensor([[448.0, -448.0, 240.0, 1e-4, 3.0, -0.0, 2 ** -9, 0.5] * 4],
                                      dtype=dtype)
    return cases


def _tie_block(block: int, unit: float, scale: float) -> torch.Tensor:
    """A block whose amax is 6 * ``scale`` (so the block scale is ``scale`` for both fp4 formats
    when ``scale`` is a power of two in range) and whose other entries sit on E2M1 tie points
    (and just off them), positive and negative."""
    vals = [6.0]
    pts = list(TIES) + [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    i = 0
    while len(vals) < block:
        v = pts[i % len(pts)] * (1 if (i // len(pts)) % 2 == 0 else -1)
        vals.append(v)
        i += 1
    return torch.tensor(vals[:block], dtype=torch.float32) * scale * unit


def _tie_tensor(fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    rows = [torch.cat([_tie_block(fmt.block, 1.0, s), _tie_block(fmt.block, -1.0, s)])
            for s in (1.0, 0.5, 2.0 ** -4, 8.0, 2.0 ** -7)]
    x = torch.stack(rows)
    assert torch.equal(x.to(dtype).float(), x), "tie points must be exact in the test dtype"
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# layout

def test_formats_and_sizes():
    assert FORMATS == ("fp8", "nvfp4", "mxfp4")
    assert (FP8_WINDOW.name, FP8_WINDOW.block) == ("fp8", 32)
    assert (NVFP4_COMPRESSED.name, NVFP4_COMPRESSED.block) == ("nvfp4", 16)
    assert (MXFP4_INDEX.name, MXFP4_INDEX.block) == ("mxfp4", 32)
    assert FP8_WINDOW.bytes_per_vector(512) == 528
    assert NVFP4_COMPRESSED.bytes_per_vector(512) == 288
    assert MXFP4_INDEX.bytes_per_vector(128) == 68
    # partial blocks round up
    assert FP8_WINDOW.bytes_per_vector(33) == 33 + 2
    assert NVFP4_COMPRESSED.bytes_per_vector(17) == 9 + 2
    assert MXFP4_INDEX.bytes_per_vector(33) == 17 + 2
    with pytest.raises(Exception):
        FP8_WINDOW.block = 16  # frozen
    with pytest.raises(ValueError):
        KVFormat("int8", 32)
    assert kq.get_format("nvfp4") is NVFP4_COMPRESSED


@pytest.mark.parametrize("fmt", ALL, ids=IDS)
def test_encode_shape_and_layout(fmt):
    x = torch.randn(2, 3, 64)
    packed = encode(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, fmt.bytes_per_vector(64))
    out = decode(packed, fmt, 64, torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        decode(packed[..., :-1], fmt, 64, torch.float32)


def test_nibble_order_and_scale_bytes():
    # nvfp4: block amax 6 -> scale e4m3(1.0) = 0x38; values 0.5 (code 1), -1 (code 0b1010).
    x = torch.zeros(16)
    x[0], x[1], x[2] = 0.5, -1.0, 6.0
    p = encode(x, NVFP4_COMPRESSED)
    assert p[0].item() == (0b1010 << 4) | 0b0001
    assert p[1].item() == 0b0111          # 6.0 -> index 7, low nibble
    assert p[-1].item() == 0x38
    # mxfp4: amax 6 -> scale 2**0 -> ue8m0 byte 127.
    x = torch.zeros(32)
    x[0] = 6.0
    assert encode(x, MXFP4_INDEX)[-1].item() == 127
    # fp8: amax 448 -> scale 1 -> byte 127; amax 449 -> scale 2 -> byte 128.
    x = torch.zeros(32)
    x[0] = 448.0
    assert encode(x, FP8_WINDOW)[-1].item() == 127
    assert encode(x, FP8_WINDOW)[0].item() == torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    x[0] = 449.0
    assert encode(x, FP8_WINDOW)[-1].item() == 128


def test_power_of_two_ceiling_is_exact():
    # Just above a power of two must go up; exactly on one must not (log2 would blur both).
    v = torch.tensor([1.0, 1.0 + 2 ** -23, 2.0 - 2 ** -22, 2.0 ** -100, 3.0 * 2 ** 60])
    e = kq._pow2_ceil_exponent(v)
    assert e.tolist() == [127, 128, 128, 27, 127 + 62]


# ---------------------------------------------------------------------------------------------
# against the oracle

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ALL, ids=IDS)
def test_fake_quantize_matches_oracle(fmt, dtype):
    for name, x in _cases(dtype).items():
        got = fake_quantize(x, fmt)
        assert got.shape == x.shape and got.dtype == x.dtype, name
        try:
            _assert_bits_equal(got, _ref(x, fmt))
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ALL, ids=IDS)
def test_round_trip_equals_fake_quantize(fmt, dtype):
    cases = _cases(dtype)
    if fmt.name != "fp8":
        cases["ties"] = _tie_tensor(fmt, dtype)
    for name, x in cases.items():
        c = x.shape[-1]
        packed = encode(x, fmt)
        assert packed.shape == (*x.shape[:-1], fmt.bytes_per_vector(c)), name
        _assert_bits_equal(decode(packed, fmt, c, dtype), fake_quantize(x, fmt))
        # and fp32 decode of the same bytes is the fp32 fake-quantised value
        assert torch.equal(decode(packed, fmt, c, torch.float32).to(dtype), fake_quantize(x, fmt))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", (NVFP4_COMPRESSED, MXFP4_INDEX), ids=["nvfp4", "mxfp4"])
def test_e2m1_ties_to_even(fmt, dtype):
    x = _tie_tensor(fmt, dtype)
    got = fake_quantize(x, fmt)
    _assert_bits_equal(got, _ref(x, fmt))
    # Direct check of the documented tie rule on the first block (scale exactly 1).
    expect = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    row = x[0, :fmt.block].float()
    out = got[0, :fmt.block].float()
    for v, q in zip(row.tolist(), out.tolist()):
        if abs(v) in expect:
            assert q == (expect[abs(v)] if v > 0 else -expect[abs(v)]), (v, q)
    # signed zero is kept
    assert torch.signbit(fake_quantize(torch.tensor([6.0] + [-0.2] * (fmt.block - 1)), fmt)[1])


def _e2m1_ties_away(normalized: torch.Tensor) -> torch.Tensor:
    """Mutant E2M1 rounding: round to nearest, ties AWAY from zero."""
    mag = normalized.abs()
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    index = torch.bucketize(mag, bounds, right=True)   # ties go up: away from zero
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    return torch.copysign(levels[index], normalized)


def _mutant_fake_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    grouped = kq._grouped(x, fmt.block)
    scale, _ = kq._block_scales(grouped, fmt.name)
    q = _e2m1_ties_away((grouped / scale).clamp(-6, 6))
    return (q * scale).flatten(-2)[..., :x.shape[-1]].to(x.dtype)


@pytest.mark.parametrize("fmt", (NVFP4_COMPRESSED, MXFP4_INDEX), ids=["nvfp4", "mxfp4"])
def test_tie_mutation_is_detected(fmt):
    """The tie inputs discriminate: ties-away rounding disagrees with the oracle on them, while
    agreeing off the tie points (so the difference is the tie rule alone)."""
    x = _tie_tensor(fmt, torch.float32)
    ref = _ref(x, fmt)
    mutant = _mutant_fake_quantize(x, fmt)
    assert not torch.equal(_bits(mutant), _bits(ref))
    assert torch.equal(_bits(fake_quantize(x, fmt)), _bits(ref))
    off_tie = torch.randn(8, 4 * fmt.block, generator=torch.Generator().manual_seed(7))
    assert torch.equal(_bits(_mutant_fake_quantize(off_tie, fmt)), _bits(_ref(off_tie, fmt)))


@pytest.mark.parametrize("fmt", ALL, ids=IDS)
def test_does_not_mutate_input_and_handles_views(fmt):
    base = torch.randn(4, 2 * 512)
    x = base[:, ::2]                      # non-contiguous
    before = x.clone()
    got = fake_quantize(x, fmt)
    assert torch.equal(x, before)
    _assert_bits_equal(got, _ref(x.contiguous(), fmt))
    _assert_bits_equal(decode(encode(x, fmt), fmt, 512, torch.float32), got)
