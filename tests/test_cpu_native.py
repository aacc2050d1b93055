"""The fused C kernels of the cpu back end (plugins/cpu/native) against the pure-torch reference
(CpuKernels), plus how the library is selected, built and loaded."""
from __future__ import annotations

import dataclasses

import logging
import subprocess

import pytest
import torch

from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer_plugins.cpu import CpuAccelerator, native, packed_weights
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

REF = CpuKernels()
SHAPES = [(1, 1024), (3, 64), (17, 256), (300, 512)]  # (T, D)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def nat() -> NativeCpuKernels:
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    return kernels


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: max error <= 1e-5 of the tensor's scale. bf16: every element within one bf16 ulp of the
    reference (plus a hair of fp32 noise for values near zero), and at most 2 % of them different:
    one rounding flip is expected, a wrong formula, index or stride is not."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all()
    scale = max(w.abs().max().item(), 1e-30)
    diff = (g - w).abs()
    if got.dtype == torch.float32:
        assert diff.max().item() <= 1e-5 * scale, f"max abs error {diff.max().item():.3g}, scale {scale:.3g}"
        return
    ulp = torch.pow(2.0, torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    worst = (diff - ulp - 1e-5 * scale).max().item()
    assert worst <= 0, f"an element is more than one bf16 ulp off (excess {worst:.3g})"
    changed = (diff > 0).float().mean().item()
    assert changed <= 0.02, f"{changed:.1%} of the elements differ from the reference"


def make(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", SHAPES)
def test_rms_norm(nat, T, D, dtype):
    x = make((T, D), dtype)
    for weight in (None, make((D,), torch.float32, 1), make((D,), torch.bfloat16, 2)):
        assert_close(nat.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))
    # a column slice of a wider projection (how the model passes it) and a 3-D input
    wide = make((T, D + 32), dtype, 3)[:, 16:16 + D]
    assert_close(nat.rms_norm(wide, None, 1e-6), REF.rms_norm(wide, None, 1e-6))
    x3 = make((T, 2, D), dtype, 4)
    assert_close(nat.rms_norm(x3, None, 1e-6), REF.rms_norm(x3, None, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17, 300])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotary(nat, T, dtype, inverse):
    d, half = 64, 8
    angles = make((T, half), torch.float32, 5) * 3
    cos, sin = angles.cos(), angles.sin()
    cases = [make((T, d), dtype), make((T, 6, d), dtype, 1),
             make((T, 3 * d + 8), dtype, 2)[:, 8:].reshape(T, 3, d)]  # strided view of a wider tensor
    for x in cases:
        assert_close(nat.rotary(x, cos, sin, inverse), REF.rotary(x, cos, sin, inverse))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 300])
def test_rms_norm_rotary(nat, T, dtype):
    d, half = 64, 8
    angles = make((T, half), torch.float32, 5) * 3
    cos, sin = angles.cos(), angles.sin()
    cases = [(make((T, d), dtype), make((d,), torch.float32, 3)), (make((T, 6, d), dtype, 1), None),
             (make((T, 3 * d + 8), dtype, 2)[:, 8:].reshape(T, 3, d), make((d,), dtype, 4))]  # a strided view
    for x, w in cases:
        got = nat.rms_norm_rotary(x, w, 1e-6, cos, sin)
        # the C norm then the C rotary, in one call: the two calls' bits
        assert torch.equal(got, nat.rotary(nat.rms_norm(x, w, 1e-6), cos, sin, False))
        normed = REF.rms_norm(x, w, 1e-6)  # the rotary against the reference on the same rounded norm
        assert_close(got, REF.rotary(normed, cos, sin, False))
        assert_close(REF.rms_norm_rotary(x, w, 1e-6, cos, sin), REF.rotary(normed, cos, sin, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", SHAPES)
def test_hc_pre(nat, T, D, dtype):
    n = 4
    streams = make((T, n, D), dtype)
    fn = make((n * (n + 2), n * D), torch.float32, 1) * 0.1
    base, scale = make((n * (n + 2),), torch.float32, 2), make((3,), torch.float32, 3).abs() + 0.5
    for iters in (20, 1):
        got = nat.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        want = REF.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        for g, w in zip(got, want):
            if g.dtype == torch.float32 and w.dtype == torch.float32 and dtype == torch.bfloat16:
                assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()  # post, comb stay fp32
            else:
                assert_close(g, w)
    # hc_pre_norm: the C hc_pre and rms_norm in one call give the two calls' bits, and the op table's
    # plain-torch default is its hc_pre followed by the reference norm (a bf16 collapse one ulp apart
    # is then more than one ulp apart after the weight, so each half is compared on its own)
    norm = make((D,), torch.float32, 4)
    fused = nat.hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-5)
    collapsed, post, comb = nat.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert torch.equal(fused[0], nat.rms_norm(collapsed, norm, 1e-5))
    assert torch.equal(fused[1], post) and torch.equal(fused[2], comb)
    assert_close(fused[0], REF.rms_norm(collapsed, norm, 1e-5))
    spec = DeepseekV4Ops().hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-5)
    spec_collapsed = DeepseekV4Ops().hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)[0]
    assert_close(spec[0], REF.rms_norm(spec_collapsed, norm, 1e-5))


def hc_pre_exact(streams, fn, base, scale, iters, eps, norm_eps):
    """hc_pre's (collapse, post, comb) in fp64, the collapse rounded once to the streams' dtype."""
    n = streams.shape[1]
    flat = streams.double().flatten(1)
    mix = flat @ fn.double().t() * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scale, base = scale.double(), base.double()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return (pre.unsqueeze(-1) * streams.double()).sum(1).to(streams.dtype), post.float(), comb.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4, 16, 21, 70])
def test_hc_pre_tiles(nat, T, dtype):
    """The C hc_pre's row blocks (16 rows: 4-row tiles, then single rows; the Sinkhorn rounds one row
    per vector lane), on fn itself and on its transposed copy, against fp64; hc_pre_norm on the
    same tiles gives hc_pre's then rms_norm's bits."""
    n, D = 4, 160
    lib = nat.native_library
    streams = make((T, n, D), dtype)
    fn = make((n * (n + 2), n * D), torch.float32, 1) * 0.05
    base, scale = make((n * (n + 2),), torch.float32, 2), make((3,), torch.float32, 3).abs() + 0.5
    norm = make((D,), torch.bfloat16, 4)
    want = hc_pre_exact(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for fn_t in (None, native.transpose_fn(fn)):
        got = native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, 20, 1e-6, 1e-6, fn_t=fn_t))
        assert_close(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
        fused = native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-5,
                                                        fn_t=fn_t))
        assert torch.equal(fused[0], nat.rms_norm(got[0], norm, 1e-5))
        assert torch.equal(fused[1], got[1]) and torch.equal(fused[2], got[2])
    # a transposed copy of the wrong shape is refused (the caller falls back), not read out of bounds
    assert native.hc_pre_arguments(lib, streams, fn, base, scale, 20, 1e-6, 1e-6, fn_t=fn.t().contiguous()[:-1]) is None


def test_hc_pre_keeps_one_transposed_fn(nat):
    """A site's fn given as hc_pre's weight is transposed once, at load; calls of 4 rows or more read that
    copy."""
    kernels = NativeCpuKernels()
    n, D = 4, 64
    fn = make((n * (n + 2), n * D), torch.float32, 1) * 0.05
    assert kernels._hc_fn_t(make((8, n, D), torch.bfloat16), fn) is None  # not given: dot products on fn
    kernels.prepare_weights([("hc_pre", fn)])
    copy = kernels._hc_fn_t(make((8, n, D), torch.bfloat16), fn)
    assert torch.equal(copy, fn.t()) and kernels._hc_fn_t(make((5, n, D), torch.bfloat16), fn) is copy
    assert kernels._hc_fn_t(make((3, n, D), torch.bfloat16), fn) is None  # one row at a time below a tile
    assert kernels._hc_fn_t(make((8, n, D), torch.float32), fn) is None  # fp32 keeps the dot products on fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", SHAPES)
@pytest.mark.parametrize("n", [4, 3])  # 4: the one-pass row (hc_post_row4), else the general loop
def test_hc_post(nat, T, D, dtype, n):
    streams, y = make((T, n, D), dtype), make((T, D), dtype, 1)
    post = torch.sigmoid(make((T, n), torch.float32, 2)) * 2
    comb = torch.softmax(make((T, n, n), torch.float32, 3), dim=-1)
    assert_close(nat.hc_post(y, streams, post, comb), REF.hc_post(y, streams, post, comb))
    y32 = y.float()  # y in fp32 with bf16 streams: out follows the streams
    assert_close(nat.hc_post(y32, streams, post, comb), REF.hc_post(y32, streams, post, comb))


def check_hc_post_pre_norm(lib, T, n, D, dtype, y_dtype, w_dtype, with_fn_t):
    """hc_post_pre_norm (one C call) gives the bits of the same library's hc_post then hc_pre_norm, into
    new tensors and into given ones."""
    streams, y = make((T, n, D), dtype), make((T, D), y_dtype, 1)
    post = torch.sigmoid(make((T, n), torch.float32, 2)) * 2
    comb = torch.softmax(make((T, n, n), torch.float32, 3), dim=-1)
    fn = make((n * (n + 2), n * D), torch.float32, 4) * 0.05
    base, scale = make((n * (n + 2),), torch.float32, 5), make((3,), torch.float32, 6).abs() + 0.5
    norm = make((D,), w_dtype, 7)
    fn_t = native.transpose_fn(fn) if with_fn_t else None
    mixed = native.hc_post(lib, y, streams, post, comb)
    want = (mixed, *native.run(lib, native.hc_pre_arguments(lib, mixed, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-5,
                                                            fn_t=fn_t)))
    for out in (None, native.hc_outputs(T, n, D, dtype)):
        got = native.run(lib, native.hc_post_pre_norm_arguments(lib, y, streams, post, comb, fn, base, scale, 20, 1e-6,
                                                                1e-6, norm, 1e-5, fn_t=fn_t, out=out))
        assert out is None or all(g is o for g, o in zip(got, out))
        for name, g, w in zip(native.HcOutputs._fields, got, want):
            assert torch.equal(g, w), f"{name} differs from hc_post then hc_pre_norm (T={T}, n={n}, {dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 4, 17, 70])
def test_hc_post_pre_norm(nat, T, dtype):
    lib = nat.native_library
    for y_dtype, w_dtype, with_fn_t in ((dtype, torch.bfloat16, False), (torch.float32, torch.float32, True)):
        check_hc_post_pre_norm(lib, T, 4, 160, dtype, y_dtype, w_dtype, with_fn_t and T >= 4)
    check_hc_post_pre_norm(lib, T, 3, 64, dtype, dtype, torch.float32, False)  # n = 3: hc_post's general loop
    # the op table: the C call where it handles the input, else the composed ops, the same bits
    n, D = 4, 64
    streams, y = make((T, n, D), dtype), make((T, D), dtype, 1)
    post, comb = torch.rand(T, n) * 2, torch.softmax(make((T, n, n), torch.float32, 3), dim=-1)
    site = (make((24, n * D), torch.float32, 4) * 0.05, make((24,), torch.float32, 5), torch.rand(3) + 0.5, 20,
            1e-6, 1e-6, make((D,), dtype, 7), 1e-5)
    nat.hc_pre_norm(streams, *site)  # fn's transposed copy (bf16 tiles) exists from a site's second call
    got = nat.hc_post_pre_norm(y, streams, post, comb, *site)
    mixed = nat.hc_post(y, streams, post, comb)
    want = (mixed, *nat.hc_pre_norm(mixed, *site))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    mixed = REF.hc_post(y, streams, post, comb)  # the plain-torch kernels: their two ops
    want = (mixed, *REF.hc_pre_norm(mixed, *site))
    assert all(torch.equal(g, w) for g, w in zip(REF.hc_post_pre_norm(y, streams, post, comb, *site), want))
    # wrong shapes are declined (the composed ops then run), not read out of bounds
    lib = nat.native_library
    assert native.hc_post_pre_norm_arguments(lib, y[:, :-1], streams, post, comb, *site) is None
    assert native.hc_post_pre_norm_arguments(lib, y, streams, post, comb[:, :-1], *site) is None
    wrong = native.hc_outputs(T + 1, n, D, dtype)
    assert native.hc_post_pre_norm_arguments(lib, y, streams, post, comb, *site, out=wrong) is None


def test_hc_post_pre_norm_buffers(nat):
    """The op table writes a chain of calls (each reading the one before's results) into two sets of
    buffers in turn, never into its inputs."""
    kernels = NativeCpuKernels()
    n, D = 4, 64
    streams, y = make((2, n, D), torch.bfloat16), make((2, D), torch.bfloat16, 1)
    post, comb = torch.rand(2, n) * 2, torch.softmax(make((2, n, n), torch.float32, 3), dim=-1)
    site = (make((24, n * D), torch.float32, 4) * 0.05, make((24,), torch.float32, 5), torch.rand(3) + 0.5, 20,
            1e-6, 1e-6, make((D,), torch.bfloat16, 7), 1e-5)
    first = kernels.hc_post_pre_norm(y, streams, post, comb, *site)
    second = kernels.hc_post_pre_norm(y, first[0], first[2], first[3], *site)
    want = kernels.hc_post(y, first[0], first[2], first[3])
    assert torch.equal(second[0], want) and second[0] is not first[0]
    third = kernels.hc_post_pre_norm(y, second[0], second[2], second[3], *site)
    assert third[0] is first[0] and torch.equal(third[0], kernels.hc_post(y, want, second[2], second[3]))
    assert kernels.hc_post_pre_norm(y[:1], streams[:1], post[:1], comb[:1], *site)[0].shape == (1, n, D)  # new shape
    rows = kernels.tuning.hc_reuse_max_rows + 1  # prefill-sized: new tensors every call
    big = (make((rows, D), torch.bfloat16, 1), make((rows, n, D), torch.bfloat16), torch.rand(rows, n),
           torch.softmax(make((rows, n, n), torch.float32, 3), dim=-1))
    assert kernels.hc_post_pre_norm(*big, *site)[0] is not kernels.hc_post_pre_norm(*big, *site)[0]


def hc_head_exact(streams, fn, base, scale, eps, norm_eps):
    """hc_head in fp64, rounded once to the streams' dtype."""
    flat = streams.double().flatten(1)
    mix = flat @ fn.double().t() * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix * scale.double() + base.double()) + eps
    return (pre.unsqueeze(-1) * streams.double()).sum(1).to(streams.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", SHAPES)
def test_hc_head(nat, T, D, dtype):
    n = 4
    streams = make((T, n, D), dtype)
    fn, base, scale = make((n, n * D), torch.float32, 1) * 0.1, make((n,), torch.float32, 2), make((1,), torch.float32, 3)
    want = hc_head_exact(streams, fn, base, scale, 1e-6, 1e-6)
    assert_close(nat.hc_head(streams, fn, base, scale, 1e-6, 1e-6), want)
    assert_close(REF.hc_head(streams, fn, base, scale, 1e-6, 1e-6), want)
    assert native.hc_head(nat.native_library, streams, fn, base, scale.expand(2), 1e-6, 1e-6) is None  # one scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_store(nat, dtype):
    T, w, m, R = 3, 40, 4, 16
    proj = make((T, 2 * w + 8), dtype)  # kv and score are column slices of one projection
    kv, score = proj[:, 8:8 + w], proj[:, 8 + w:]
    ape = make((m, w), torch.float32, 1)
    position_mod, ring_row = torch.tensor([3, 0, 2]), torch.tensor([5, 14, 0])
    rows = [make((R, w), torch.float32, 2) for _ in range(2)]
    want = [r.clone() for r in rows]
    DeepseekV4Ops().compress_store(kv, score, ape, position_mod, ring_row, *want)  # the op table's default
    exact_score = score.double() + ape.double()[position_mod]
    assert torch.equal(want[0][ring_row], kv.float()) and torch.equal(want[1][ring_row], exact_score.float())
    assert nat.compress_store(kv, score, ape, position_mod, ring_row, *rows)
    assert torch.equal(rows[0], want[0]) and torch.equal(rows[1], want[1])  # copies and one fp32 add: exact
    lib = nat.native_library
    assert not native.compress_store(lib, kv, score, ape, position_mod.clamp(max=m) + 1, ring_row, *rows)  # >= m
    assert not native.compress_store(lib, kv, score, ape, position_mod, ring_row + R, *rows)  # outside the rings
    assert not native.compress_store(lib, kv, score.half(), ape, position_mod, ring_row, *rows)  # fp16
    assert torch.equal(rows[0], want[0]) and torch.equal(rows[1], want[1])  # a refused call writes nothing


def test_kernel_call_takes_exactly_its_arguments(nat):
    from deepinfer_plugins.cpu.native import binding, norm_rope
    kernel = norm_rope._RMS_NORM
    with pytest.raises(TypeError, match="rms_norm"):
        kernel(nat.native_library, x=0)  # missing arguments
    values = dict.fromkeys(kernel.arguments, 0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        kernel(nat.native_library, **values, extra=1)
    with pytest.raises(ValueError, match="identifiers"):
        binding._keyword_call("rms_norm", ("x", "rows); import os; os.getcwd("))


def test_unsupported_input_falls_back(nat):
    x = make((4, 32), torch.float16)
    assert native.rms_norm_arguments(nat.native_library, x, None, 1e-6) is None
    assert torch.equal(nat.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6))
    cos = sin = torch.ones(1, 8)  # a broadcast table: the reference handles it
    assert torch.equal(nat.rotary(make((4, 64), torch.float32), cos, sin, False),
                       REF.rotary(make((4, 64), torch.float32), cos, sin, False))


def test_accelerator_uses_native_kernels(nat):
    accel = CpuAccelerator()
    assert accel.native_library is not None and accel.capabilities().fast_paths == ("native_c",)


def test_disabled_by_environment_uses_pure_torch(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")
    accel = CpuAccelerator()
    assert accel.native_library is None and accel.capabilities().fast_paths == ()
    x = make((3, 64), torch.bfloat16)
    assert torch.equal(accel.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6))
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_NATIVE"):
        native.enabled()


def test_one_openmp_runtime(nat):
    """The library must share torch's libgomp: a second OpenMP runtime would oversubscribe the cores."""
    with open("/proc/self/maps") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) == 1, f"more than one OpenMP runtime is loaded: {sorted(gomps)}"


def test_broken_compiler_warns_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deepinfer"):
            kernels = NativeCpuKernels()
            x = make((3, 64), torch.float32)
            assert torch.equal(kernels.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6))
            assert kernels.native_library is None
            kernels.rotary(make((3, 64), torch.float32), torch.ones(3, 8), torch.zeros(3, 8), False)
        warnings = [r for r in caplog.records if "native C kernels" in r.getMessage()]
        assert len(warnings) == 1 and "/bin/false" in warnings[0].getMessage()
        assert "install a C compiler" in warnings[0].getMessage()
        assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))
    finally:
        native.library.cache_clear()  # later users rebuild (or find) the real library


@pytest.mark.slow
def test_cache_key_follows_the_cpu(monkeypatch, tmp_path, compile_once):
    # the library is built for this CPU (-march=native): another CPU's features name another file
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    here = native._build()
    assert here.exists() and native._cpu_features()
    monkeypatch.setattr(native.build, "_cpu_features", lambda: "sse2")
    assert native._build() != here


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", SHAPES)
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu(nat, T, D, dtype, limit):
    # the halves of a fused gate/up product (strided rows), as the model and the experts pass them;
    # the reference in fp32 rounded once (torch rounds silu's bf16 result before the product)
    gate_up = make((T, 2 * D), dtype) * 6
    gate, up = gate_up[:, :D], gate_up[:, D:]
    want = REF.swiglu(gate.float(), up.float(), limit).to(dtype)
    assert_close(native.swiglu(nat.native_library, gate, up, limit), want)
    if gate.numel() < 4096:  # small inputs stay on the reference kernel
        assert torch.equal(nat.swiglu(gate, up, limit), REF.swiglu(gate, up, limit))
    else:
        assert_close(nat.swiglu(gate, up, limit), want)
    separate = make((T, D), dtype, 1)  # gate and up not halves of one tensor: the reference path
    assert native.swiglu(nat.native_library, gate, separate, limit) is None
    assert torch.equal(nat.swiglu(gate, separate, limit), REF.swiglu(gate, separate, limit))


def test_swiglu_exp_over_the_whole_range(nat):
    # the vectorised exp inside: silu(x) = x * sigmoid(x) from -120 to 120 (saturated tails included)
    x = torch.linspace(-120, 120, 200_001).view(-1, 1)
    both = torch.cat((x, torch.ones_like(x)), dim=1)
    got = native.swiglu(nat.native_library, both[:, :1], both[:, 1:], 0.0).double()
    want = x.double() * torch.sigmoid(x.double())
    assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-30).all()


# tails of rows (blocks of 4 and 16) and of K (vectors of 16 and 32), rows shorter than a vector, and
# enough rows for the prefetch to run past the end of the weight
@pytest.mark.parametrize("N,K", [(1, 32), (7, 70), (100, 384), (1344, 1024), (5, 8), (9, 33), (4099, 64)])
def test_gemv_bf16(nat, N, K):
    # the decode GEMV: fp32 sums of exact bf16 products, rounded once, like torch.mv
    W, x = make((N, K), torch.bfloat16), make((K,), torch.bfloat16, 1)
    got = native.run(nat.native_library, native.gemv_bf16_arguments(nat.native_library, W, x))
    want = (W.double() @ x.double()).to(torch.bfloat16)
    assert_close(got, want)
    assert_close(nat.linear(x.view(1, 1, K), W).view(N), want)  # the linear's one-row path uses it
    assert native.gemv_bf16_arguments(nat.native_library, W.float(), x.float()) is None  # fp32: torch.mv
    if N > 1:  # rows further apart than K: the reference
        assert native.gemv_bf16_arguments(nat.native_library, make((N, K + 8), torch.bfloat16)[:, :K], x) is None


@pytest.mark.parametrize("m,N,K", [(2, 7, 70), (5, 100, 384), (16, 1344, 1024), (3, 9, 8)])
def test_gemv_tokens_bf16(nat, m, N, K):
    # a decode batch's linear: each token's row exactly as the one-token GEMV computes it
    W, x = make((N, K), torch.bfloat16), make((m, K), torch.bfloat16, 1)
    got = native.gemv_tokens_bf16(nat.native_library, x, W)
    assert_close(got, (x.double() @ W.double().t()).to(torch.bfloat16))
    for t in range(m):
        lib = nat.native_library
        assert torch.equal(got[t], native.run(lib, native.gemv_bf16_arguments(lib, W, x[t])))
    if m <= nat.tuning.gemv_tokens_max_rows:  # the linear's decode-batch path on this tier
        assert torch.equal(nat.linear(x.view(1, m, K), W).view(m, N), got)
    assert native.gemv_tokens_bf16(nat.native_library, x.float(), W.float()) is None
    assert native.gemv_tokens_bf16(nat.native_library, x[:, :K - 1], W) is None


def check_packed_gemm(lib, M, N, K):
    """packed_gemm.c on one shape: fp32 sums of exact bf16 products rounded once, against fp64."""
    W, x = make((N, K), torch.bfloat16), make((M, K), torch.bfloat16, 1)
    packed = native.pack_bf16(lib, W)
    assert packed.shape == native.packed_shape(lib, N, K) and packed.shape[2] == native.packed_cols(lib)
    assert_close(native.packed_linear_bf16(lib, x, packed, (N, K)), (x.double() @ W.double().t()).to(torch.bfloat16))
    return W, x, packed


# M across the 4-row tiles and their tails (1..65), N not a multiple of 16 (or of the 4-block panels),
# K odd and not a multiple of 32
# (from 7 rows on AVX2 the K-blocked tiles: groups of <= 6 rows, slabs of 64 rows, blocks of 64 K pairs)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13, 16, 31, 32, 64, 65, 130])
@pytest.mark.parametrize("N,K", [(1, 1), (17, 33), (100, 70), (300, 2), (1000, 129), (50, 300)])
def test_packed_gemm_bf16(nat, M, N, K):
    lib = nat.native_library
    W, x, packed = check_packed_gemm(lib, M, N, K)
    if K > 1:  # x of another K (with K even, one whose packing has the same shape)
        assert native.packed_linear_bf16(lib, x[:, :K - 1], packed, (N, K)) is None
    assert native.packed_linear_bf16(lib, x, packed, (N + 16, K)) is None  # another N
    assert native.packed_linear_bf16(lib, x.float(), packed, (N, K)) is None
    assert native.pack_bf16(lib, W.float()) is None
    if N > 1 and K > 1:
        assert native.pack_bf16(lib, W.t()) is None  # not contiguous
    # x rows starting off a 4-byte boundary (an odd element offset): copied into the tiles' layout
    odd = make((M * K + 1,), torch.bfloat16, 2)[1:].view(M, K)
    assert torch.equal(native.packed_linear_bf16(lib, odd, packed, (N, K)),
                       native.packed_linear_bf16(lib, odd.clone(), packed, (N, K)))
    # a stack of weights: each packed as on its own
    stack = make((3, N, K), torch.bfloat16, 3)
    assert torch.equal(native.pack_bf16(lib, stack), torch.stack([native.pack_bf16(lib, w) for w in stack]))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 65, 300])
def test_linear_on_packed_tiles(rows):
    # the decode batches' linears: on the tiles (the copy made at load) within the tier's rows
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build")
    W, x = make((130, 96), torch.bfloat16), make((rows, 96), torch.bfloat16, 1)
    kernels.prepare_weights([("linear", W)])
    want = (x.double() @ W.double().t()).to(torch.bfloat16)
    for _ in range(3):
        assert_close(kernels.linear(x.view(1, rows, 96), W).view(rows, 130), want)
    low, high = kernels.tuning.packed_gemm_rows
    if low <= rows <= high:
        assert torch.equal(kernels.linear(x, W), native.packed_linear_bf16(kernels.native_library, x,
                                                                           kernels.tile_weights.lookup(W), W.shape))


def test_one_row_on_tiles_for_large_weights_on_avx2(monkeypatch):
    # the AVX2 tier's LM head: one row on the tiles, from a weight size on (lowered here); smaller weights
    # keep the GEMV, and the other tiers their own row range
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build")
    if native.gemv_tier(kernels.native_library) == "avx2-fma":
        kernels.tuning = dataclasses.replace(kernels.tuning, one_row_tiles_min_elements=130 * 96)
    large, small = make((130, 96), torch.bfloat16), make((129, 96), torch.bfloat16, 1)
    x, lib = make((1, 96), torch.bfloat16, 2), kernels.native_library
    kernels.prepare_weights([("linear", large), ("linear", small)])
    for W in (large, small):
        want = (x.double() @ W.double().t()).to(torch.bfloat16)
        for _ in range(3):
            assert_close(kernels.linear(x, W), want)
    avx2, one_row = native.gemv_tier(lib) == "avx2-fma", kernels.tuning.packed_gemm_rows[0] == 1
    for W, on_tiles in ((large, avx2 or one_row), (small, one_row)):
        want = native.packed_linear_bf16(lib, x, kernels.tile_weights.lookup(W), W.shape) if on_tiles else \
            native.run(lib, native.gemv_bf16_arguments(lib, W, x)).view(1, -1)
        assert torch.equal(kernels.linear(x, W), want)


def test_packed_gemm_bf16_stacked(nat):
    # a 3-D weight (stacked experts or groups): each matrix packed apart
    lib, W = nat.native_library, make((3, 40, 70), torch.bfloat16)
    packed = native.pack_bf16(lib, W)
    assert packed.shape == (3, *native.packed_shape(lib, 40, 70))
    for e in range(3):
        assert torch.equal(packed[e], native.pack_bf16(lib, W[e].contiguous()))
    assert native.pack_bf16(lib, make((2, 3, 40, 70), torch.bfloat16)) is None  # 4-D


def test_moe_experts_on_packed_tiles(nat, monkeypatch):
    # prefill-sized expert rows (above the C expert kernel's limit): with the stacks' copies (made at load),
    # each expert's rows on the packed tiles where the tier's tile rows cover them, rounded where the
    # composed path rounds (gate/up, swiglu, output)
    if nat.native_amx:
        pytest.skip("with AMX tiles the C expert kernel takes more rows per expert than the register tiles do "
                    "(tuning.expert_rows_per_expert_amx): the tiles never run the routed experts there")
    counts, D, inter, limit = [40, 0, 35, 33], 64, 128, 7.0  # each expert's hidden >= 4096: the C swiglu
    E, n = len(counts), sum(counts)
    rows, w13, w2 = make((n, D), torch.bfloat16), make((E, 2 * inter, D), torch.bfloat16, 1), \
        make((E, D, inter), torch.bfloat16, 2)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).view(n, 1)
    grouped, plan = nat.moe_dispatch(rows, ids, E)
    assert n > nat._native_expert_rows(E)
    nat.prepare_weights([("moe_experts", w13), ("moe_experts", w2)])
    low, high = nat.tuning.packed_gemm_rows
    for _ in range(3):
        got = nat.moe_experts(grouped, plan, w13, w2, limit)
    if not low <= max(counts) <= high:
        assert nat._tile_experts(grouped, plan, w13, w2, limit) is None
        return
    assert_close(got, experts_reference(grouped, counts, w13, w2, limit))
    lib, start, want = nat.native_library, 0, []
    for e, c in enumerate(counts):
        if c:
            gu = native.packed_linear_bf16(lib, grouped[start:start + c], native.pack_bf16(lib, w13[e]), (2 * inter, D))
            h = nat.swiglu(gu[:, :inter], gu[:, inter:], limit)
            want.append(native.packed_linear_bf16(lib, h, native.pack_bf16(lib, w2[e]), (D, inter)))
        start += c
    assert torch.equal(got, torch.cat(want))
    # where the tiles decline (here: a tile call that returns None) the composed path runs
    monkeypatch.setattr(native, "packed_linear_bf16", lambda *a: None)
    composed = CpuKernels.moe_experts(nat, grouped, plan, w13, w2, limit)
    assert torch.equal(nat.moe_experts(grouped, plan, w13, w2, limit), composed)


@pytest.mark.parametrize("T", [2, 40])
def test_grouped_linear_on_packed_tiles(nat, T):
    x, w = make((T, 3, 70), torch.bfloat16), make((3, 50, 70), torch.bfloat16, 1)
    nat.prepare_weights([("grouped_linear", w)])
    want = torch.einsum("tgk,gnk->tgn", x.double(), w.double()).to(torch.bfloat16)
    for _ in range(3):
        got = nat.grouped_linear(x, w)
        assert_close(got, want)
    low, high = nat.tuning.packed_gemm_rows
    if max(low, 16) <= T <= high and not (nat.native_amx and T <= 64):  # from 16 tokens (a call per group)
        packed = nat.tile_weights.lookup(w)
        assert packed is not None
        for g in range(3):
            assert torch.equal(got[:, g], native.packed_linear_bf16(nat.native_library, x[:, g], packed[g], (50, 70)))


def experts_reference(rows, counts, w13, w2, limit, torch_swiglu=False):
    """Exact products of the bf16 inputs, rounded where the C kernel rounds: gate/up, hidden (swiglu
    rounded once), output. `torch_swiglu`: where the pure-torch experts round instead, silu's result
    and then its product with up (torch's bf16 `F.silu(g) * u`)."""
    out, start, inter = [], 0, w2.shape[2]
    hi = limit if limit > 0 else float("inf")
    for e, c in enumerate(counts):
        for t in range(start, start + c):
            gu = (w13[e].double() @ rows[t].double()).to(torch.bfloat16).double()
            g, u = gu[:inter].clamp(max=hi), gu[inter:].clamp(min=-hi, max=hi)
            if torch_swiglu:
                h = ((g * torch.sigmoid(g)).to(torch.bfloat16).double() * u).to(torch.bfloat16)
            else:
                h = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
            out.append((w2[e].double() @ h.double()).to(torch.bfloat16))
        start += c
    return torch.stack(out)


# D % 64 == 0 runs on AMX tiles where the CPU has them (16 tokens per tile: 20 and 35 rows span
# several), D = 70 on the dot products
EXPERT_CASES = [([1, 0, 2, 1], 64, 32), ([0, 3, 0, 0, 1, 5, 0, 1], 70, 48), ([1] * 4 + [0] * 28, 1024, 512),
                ([20, 0, 35, 16], 128, 64)]


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("counts,D,inter", EXPERT_CASES)  # empty experts, a K tail (70), model size
def test_experts_bf16(nat, counts, D, inter, limit):
    E, n = len(counts), sum(counts)
    rows, w13, w2 = make((n, D), torch.bfloat16), make((E, 2 * inter, D), torch.bfloat16, 1), \
        make((E, D, inter), torch.bfloat16, 2)
    want = experts_reference(rows, counts, w13, w2, limit)
    got = native.experts_bf16(nat.native_library, rows, torch.tensor(counts), w13, w2, limit)
    assert_close(got, want)
    # through the accelerator method, with the plan the dispatch makes (rows grouped by expert)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).view(n, 1)
    grouped, plan = nat.moe_dispatch(rows, ids, E)
    through = nat.moe_experts(grouped, plan, w13, w2, limit)
    if n <= nat._native_expert_rows(E):  # the C kernel runs (every case where AMX tiles are usable)
        assert torch.equal(through, got)
    else:
        # Above the C kernel's row limit (without AMX: 16 rows per expert on average on the vector tiers,
        # 48 in all on the portable one; e.g. the 71 rows of [20, 0, 35, 16])
        # the pure-torch experts run. They round where torch's bf16 ops round: silu's result, then
        # its product with up. That differs from the C kernel's single rounding by a bf16 ulp in
        # many hidden elements, a few ulps of the output after w2's sum, so they are held to their
        # own rounding points here, not to the C kernel's.
        assert torch.equal(through, REF.moe_experts(grouped, plan, w13, w2, limit))
        assert_close(through, experts_reference(rows, counts, w13, w2, limit, torch_swiglu=True))


def test_experts_bf16_declines_what_it_does_not_handle(nat, monkeypatch):
    lib, counts = nat.native_library, torch.tensor([2, 1])
    rows, w13, w2 = make((3, 64), torch.bfloat16), make((2, 64, 64), torch.bfloat16), make((2, 64, 32), torch.bfloat16)
    assert native.experts_bf16(lib, rows.float(), counts, w13.float(), w2.float(), 0.0) is None  # fp32
    assert native.experts_bf16(lib, rows, torch.tensor([2, 2]), w13, w2, 0.0) is None  # counts != rows
    assert native.experts_bf16(lib, rows, torch.tensor([4, -1]), w13, w2, 0.0) is None  # a negative count
    assert native.experts_bf16(lib, rows, counts, w13, w2[:, :32], 0.0) is None  # w2 of the wrong shape
    # above the row limit (prefill-sized) oneDNN's per-expert GEMMs run instead
    calls = []
    monkeypatch.setattr(native, "experts_bf16", lambda *a: calls.append(a) or None)
    n = nat._native_expert_rows(2) + 1
    many = make((n, 64), torch.bfloat16)
    grouped, plan = nat.moe_dispatch(many, torch.arange(n).remainder(2).view(n, 1), 2)
    out = nat.moe_experts(grouped, plan, w13, w2, 0.0)
    assert out.shape == (n, 64) and not calls


def test_argmax_logsumexp(nat):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 4
    logits[0, 3] = logits[0, 900] = 50.0  # a tie: the first index, as argmax
    logits[1] = float("-inf")  # a dead row
    logits[1, 10] = 0.0
    logits[2, :500] = float("-inf")
    logits[3] = float("-inf")  # every token masked: torch's answer (-inf)
    logits[4, 7] = float("inf")
    logits[5, 2] = float("nan")
    index, log_norm = nat.argmax_logsumexp(logits)
    want_index, want_norm = REF.argmax_logsumexp(logits)  # the interface's default: max + logsumexp
    assert torch.equal(index, want_index)
    assert torch.allclose(log_norm, want_norm, rtol=2e-6, atol=0, equal_nan=True)
    # rows further apart than V (a slice of a wider buffer)
    wide = torch.randn(4, 1100, generator=g)
    got = nat.argmax_logsumexp(wide[:, :1000])
    assert torch.equal(got[0], wide[:, :1000].argmax(-1))
    assert torch.allclose(got[1], torch.logsumexp(wide[:, :1000], -1), rtol=2e-6)
    assert native.argmax_logsumexp(nat.native_library, logits.double()) is None  # fp32 only


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("L", [1, 2, 5])
def test_argmax_logsumexp_blocks(nat, threads, L):
    # rows of many 2048-float blocks, split over 1-3 threads:
    # the max in a later block, ties across blocks (the first wins), leading
    # all -inf blocks (a masked prefix), a NaN behind them, and the fp64 reference
    g = torch.Generator().manual_seed(1)
    V = 9 * 2048 + 77
    logits = torch.randn(L, V, generator=g) * 4
    logits[0, V - 5] = 40.0
    if L > 1:
        logits[1, 2047] = logits[1, 2048] = logits[1, V - 1] = 30.0
        logits[1, :2047] = float("-inf")
    if L > 2:
        logits[2, :3 * 2048] = float("-inf")
        logits[2, 100] = float("nan")
        logits[3, 4 * 2048:] = float("-inf")
        logits[4] = float("-inf")
        logits[4, V - 1] = 1.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        index, log_norm = native.argmax_logsumexp(nat.native_library, logits)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(index, logits.argmax(-1))
    want = torch.logsumexp(logits.double(), -1).float()
    assert torch.allclose(log_norm, want, rtol=2e-6, atol=0, equal_nan=True)


def indexer_scores_exact(q, w, keys, mask):
    """The lightning indexer's scores in fp64, -inf where not visible."""
    dots = torch.einsum("bshd,bed->bshe", q.double(), keys.double()).relu()
    return (dots * w.double().unsqueeze(-1)).sum(2).masked_fill(~mask, float("-inf"))


def check_indexer_scores(lib, dtype, B, S, Hi, di, E, seed=0):
    q, keys = make((B, S, Hi, di), dtype, seed), make((B, E, di), dtype, seed + 1)
    w = make((B, S, Hi), torch.float32, seed + 2)
    mask = torch.rand(B, S, E, generator=torch.Generator().manual_seed(seed)) > 0.3
    got, want = native.indexer_scores(lib, q, w, keys, mask), indexer_scores_exact(q, w, keys, mask)
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), ~mask)
    scale = want[mask].abs().max().item() if mask.any() else 1.0
    assert (got.double() - want)[mask].abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,Hi,di,E", [(1, 1, 8, 64, 37), (3, 2, 4, 32, 5), (2, 1, 64, 128, 300)])
def test_indexer_scores(nat, dtype, B, S, Hi, di, E):
    check_indexer_scores(nat.native_library, dtype, B, S, Hi, di, E)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,k", [(37, 16), (10, 16)])
def test_indexer_topk_decode(nat, dtype, E, k):
    # the decode path (C scores, torch top-k) picks what the reference picks; invisible picks are -1
    B, S, Hi, di = 2, 1, 8, 64
    q, keys, w = make((B, S, Hi, di), dtype), make((B, E, di), dtype, 1), make((B, S, Hi), torch.float32, 2)
    mask = torch.rand(B, S, E, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[1] = False  # a query that sees nothing
    assert torch.equal(nat.indexer_topk(q, w, keys, mask, k), REF.indexer_topk(q, w, keys, mask, k))


def route_exact(scores, bias, k, scaling, hash_ids):
    """moe_route in fp64 (choice by fp32 scores + bias, like the kernels)."""
    ids = hash_ids if hash_ids is not None else (scores + bias if bias is not None else scores).topk(k, dim=-1).indices
    s = scores.double().gather(1, ids)
    return s / (s.sum(-1, keepdim=True) + 1e-20) * scaling, ids


@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (7, 256, 6), (3, 5, 5)])
def test_moe_route_rows(nat, T, E, k):
    g = torch.Generator().manual_seed(E)
    scores = torch.nn.functional.softplus(torch.randn(T, E, generator=g)).sqrt()
    bias = torch.randn(E, generator=g) * 0.1
    hash_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    for b, h in ((bias, None), (None, None), (None, hash_ids)):
        weights, ids = nat.moe_route(scores, b, k, 1.5, h)
        want_w, want_ids = route_exact(scores, b, k, 1.5, h)
        assert ids.dtype == torch.long and torch.equal(ids, want_ids)
        assert weights.dtype == torch.float32 and torch.allclose(weights.double(), want_w, rtol=1e-6, atol=0)
        ref_w, ref_ids = REF.moe_route(scores, b, k, 1.5, h)
        assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_w, rtol=1e-6, atol=0)
    lib = nat.native_library
    assert native.moe_route_rows(lib, scores, None, E + 1, 1.0, None) is None  # more choices than experts
    assert native.moe_route_rows(lib, scores, None, k, 1.0, hash_ids.clamp(max=0) - 1) is None  # an id < 0
    assert native.moe_route_rows(lib, scores.double(), None, k, 1.0, None) is None  # fp32 only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 300])
def test_moe_dispatch_and_combine(nat, T, dtype):
    g = torch.Generator().manual_seed(T)
    E, k = 8, 3
    x = make((T, 64), dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    rows, plan = nat.moe_dispatch(x, ids, E)
    want_rows, want_plan = REF.moe_dispatch(x, ids, E)  # the stable argsort grouping
    assert torch.equal(rows, want_rows) and plan.num_tokens == want_plan.num_tokens == T
    for field in ("tokens_per_expert", "source_token", "source_slot"):
        assert torch.equal(getattr(plan, field), getattr(want_plan, field)), field
    out_rows = make(rows.shape, dtype, 1)
    got = nat.moe_combine(out_rows, plan, weights)
    exact = torch.zeros(T, 64, dtype=torch.float64).index_add_(
        0, plan.source_token, out_rows.double() * weights.double()[plan.source_token, plan.source_slot].unsqueeze(1))
    assert got.dtype == torch.float32 and torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, REF.moe_combine(out_rows, plan, weights), rtol=1e-5, atol=1e-5)


def test_moe_dispatch_and_combine_decline(nat):
    lib = nat.native_library
    x = make((4, 16), torch.bfloat16)
    assert native.moe_dispatch_rows(lib, x, torch.tensor([[0, 9]] * 4), 8) is None  # an id outside [0, E)
    assert native.moe_dispatch_rows(lib, x, torch.tensor([[0, -1]] * 4), 8) is None
    rows, plan = nat.moe_dispatch(x, torch.tensor([[0, 1]] * 4), 8)
    twice = plan.source_slot.clone()
    twice[:] = 0  # two rows claim the same (token, choice): not a full grouping
    assert native.moe_combine_rows(lib, rows, plan.source_token, twice, torch.rand(4, 2)) is None
    # a subset of the choices (e.g. local experts only) goes to the reference's scatter-add
    subset = type(plan)(plan.tokens_per_expert, plan.source_token[:5], plan.source_slot[:5], 4)
    w = torch.rand(4, 2)
    assert torch.allclose(nat.moe_combine(rows[:5], subset, w), REF.moe_combine(rows[:5], subset, w))


def moe_case(T, D, E, k, inter, shared_inter, hashed, seed=0):
    """Inputs of one MoE sub-layer (bf16 activations and experts, fp32 router) as moe_sublayer takes them."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g)).to(torch.bfloat16)
    gate = torch.randn(E, D, generator=g) / D ** 0.5
    bias = None if hashed else torch.randn(E, generator=g) * 0.1
    hash_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if hashed else None
    w13 = (torch.randn(E, 2 * inter, D, generator=g) / D ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, inter, generator=g) / inter ** 0.5).to(torch.bfloat16)
    sw13 = (torch.randn(2 * shared_inter, D, generator=g) / D ** 0.5).to(torch.bfloat16) if shared_inter else None
    sw2 = (torch.randn(D, shared_inter, generator=g) / shared_inter ** 0.5).to(torch.bfloat16) if shared_inter else None
    return x, gate, bias, hash_ids, w13, w2, sw13, sw2


def moe_sublayer_exact(x, gate, bias, hash_ids, w13, w2, sw13, sw2, k, scaling, scoring, limit,
                       torch_swiglu=(False, False)):
    """moe_sublayer in fp64, rounded to bf16 where the kernels' bf16 products and swiglu round (each
    expert's gate/up, hidden and output; the shared expert's likewise); router, weights and sums exact.
    `torch_swiglu` (routed, shared): that swiglu rounds as torch's bf16 ops (silu, then the product)."""
    logits = x.double() @ gate.double().t()
    scores = {"sqrtsoftplus": lambda v: torch.nn.functional.softplus(v).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda v: v.softmax(-1)}[scoring](logits)
    ids = hash_ids if hash_ids is not None else (scores + (0 if bias is None else bias.double())).topk(k, -1).indices
    chosen = scores.gather(1, ids)
    weights = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * scaling
    hi = limit if limit > 0 else float("inf")

    def expert(v, a, b, round_silu):
        gu = (a.double() @ v.double()).to(torch.bfloat16).double()
        inter = b.shape[1]
        gg, u = gu[:inter].clamp(max=hi), gu[inter:].clamp(min=-hi, max=hi)
        silu = gg * torch.sigmoid(gg)
        h = ((silu.to(torch.bfloat16).double() if round_silu else silu) * u).to(torch.bfloat16).double()
        return (b.double() @ h).to(torch.bfloat16).double()

    out = []
    for t in range(x.shape[0]):
        y = sum(weights[t, j] * expert(x[t], w13[ids[t, j]], w2[ids[t, j]], torch_swiglu[0]) for j in range(k))
        out.append(y if sw13 is None else y + expert(x[t], sw13, sw2, torch_swiglu[1]))
    return torch.stack(out).to(torch.bfloat16)


MOE_CASES = [  # (T, D, E, k, inter, shared_inter, hashed, scoring): decode batches, hash layers, no shared
    (1, 256, 16, 4, 64, 64, False, "sqrtsoftplus"), (3, 128, 8, 2, 32, 48, True, "sqrtsoftplus"),
    (8, 70, 16, 4, 48, 0, False, "sigmoid"), (2, 64, 6, 6, 32, 32, False, "softmax"),
    # batches of several rows per expert (the routed experts on the register tiles): odd K and N tails,
    # experts with no rows, one with many
    (16, 128, 16, 4, 40, 48, False, "sqrtsoftplus"), (64, 96, 8, 2, 24, 33, True, "sigmoid")]


@pytest.mark.parametrize("T,D,E,k,inter,shared_inter,hashed,scoring", MOE_CASES)
def test_moe_layer_bf16(nat, T, D, E, k, inter, shared_inter, hashed, scoring):
    case = moe_case(T, D, E, k, inter, shared_inter, hashed)
    args = (k, 1.5, scoring, 10.0)
    lib = nat.native_library
    x, gate, bias, hash_ids, w13, w2, sw13, sw2 = case
    # the routed experts and the shared expert on their packed copies (register tiles) or the GEMVs
    experts = native.pack_bf16(lib, w13), native.pack_bf16(lib, w2)
    shared = (native.pack_bf16(lib, sw13), native.pack_bf16(lib, sw2)) if shared_inter else None
    for round_silu in (False, True):
        want = moe_sublayer_exact(*case, *args, torch_swiglu=(False, round_silu))
        assert_close(native.moe_layer_bf16(lib, *case, *args, round_silu), want)
        got = native.moe_layer_bf16(lib, *case, *args, round_silu, packed_experts=experts, packed_shared=shared)
        assert_close(got, want)
    # a packed copy of another layout than its weight's is not used (the plain weight is)
    wrong = native.pack_bf16(lib, w13[:, :8].contiguous()), experts[1]
    assert torch.equal(native.moe_layer_bf16(lib, *case, *args, packed_experts=wrong),
                       native.moe_layer_bf16(lib, *case, *args))
    # the accelerator's op, fused where the composed path would run the same C stages (the shared
    # expert's swiglu rounded as the composed path's: torch's ops below 4,096 elements, its products on
    # the kernels the composed linear picks): the same bits as the back end's own composition but where
    # the router's fp32 sums differ (torch's vs the C dot) and, on the tiles, the routed experts' sums.
    nat.prepare_weights([("moe_experts", w13), ("moe_experts", w2), ("linear", case[-2]), ("linear", case[-1])])
    for _ in range(2):
        composed = super(NativeCpuKernels, nat).moe_sublayer(*case, *args)
        assert_close(nat.moe_sublayer(*case, *args), composed)
    # the plain-torch composition (CpuKernels, the spec) against the fp64 one with torch's roundings
    assert_close(REF.moe_sublayer(*case, *args), moe_sublayer_exact(*case, *args, torch_swiglu=(True, True)))


def test_moe_layer_bf16_declines_what_it_does_not_handle(nat, monkeypatch):
    lib = nat.native_library
    x, gate, bias, hash_ids, w13, w2, sw13, sw2 = moe_case(2, 64, 8, 2, 32, 32, False)
    args = (2, 1.0, "sqrtsoftplus", 0.0)
    assert native.moe_layer_bf16(lib, x.float(), gate, bias, None, w13, w2, sw13, sw2, *args) is None  # fp32 x
    assert native.moe_layer_bf16(lib, x, gate.bfloat16(), bias, None, w13, w2, sw13, sw2, *args) is None  # bf16 router
    assert native.moe_layer_bf16(lib, x, gate, bias, None, w13, w2, sw13, sw2, 2, 1.0, "tanh", 0.0) is None
    assert native.moe_layer_bf16(lib, x, gate, bias, None, w13, w2[:, :32], sw13, sw2, *args) is None  # w2 shape
    assert native.moe_layer_bf16(lib, x, gate, bias, None, w13, w2, sw13, None, *args) is None  # half a shared expert
    assert native.moe_layer_bf16(lib, x, gate, bias, None, w13, w2, sw13, sw2, 9, 1.0, "sigmoid", 0.0) is None
    bad_hash = torch.full((2, 2), 8)
    assert native.moe_layer_bf16(lib, x, gate, None, bad_hash, w13, w2, sw13, sw2, *args) is None  # id >= E
    with pytest.raises(Exception):  # the composed path names the bad id
        nat.moe_sublayer(x, gate, None, bad_hash, w13, w2, sw13, sw2, *args)
    # more rows than the decode-batch GEMV takes without the register tiles (packing off), more than the
    # fused call takes at all, or fp32: the composed path, not the fused call
    calls = []
    monkeypatch.setattr(native, "moe_layer_bf16", lambda *a, **kw: calls.append(kw) or None)
    many = make((nat.tuning.gemv_tokens_max_rows + 1, 64), torch.bfloat16)
    plain = NativeCpuKernels()
    plain.pack_weights = False  # as the accelerator sets it under DEEPINFER_CPU_PACKED_WEIGHTS=0
    assert plain.moe_sublayer(many, gate, bias, None, w13, w2, sw13, sw2, *args).shape == many.shape
    assert not calls
    one_each = moe_case(nat.tuning.moe_fused_max_tokens + 1, 64, 16, 1, 32, 32, False)
    for _ in range(2):
        assert nat.moe_sublayer(*one_each, 1, 1.0, "sigmoid", 0.0).shape == one_each[0].shape
    assert not calls
    one = x[:1].float()  # a row count the fused call takes on every tier (the portable one: one row)
    nat.moe_sublayer(one, gate, bias, None, w13.float(), w2.float(), sw13.float(), sw2.float(), *args)
    assert len(calls) == 1  # tried (it declines fp32), then composed


def test_moe_sublayer_runs_decode_batches_on_the_tiles(nat, monkeypatch):
    """16 and 64 tokens: the fused call, its routed and shared experts on their packed copies, made at load
    (on the tiers with register tiles)."""
    if nat.native_amx or nat.tuning.packed_gemm_rows == (0, 0):
        pytest.skip("the fused MoE takes 16 tokens on the AVX2 and AVX512-BF16 register tiles (not with AMX)")
    calls, fused = [], native.moe_layer_bf16
    monkeypatch.setattr(native, "moe_layer_bf16", lambda *a, **kw: calls.append(kw) or fused(*a, **kw))
    for T in (16, 64):
        case = moe_case(T, 64, 16, 4, 32, 32, False)
        nat.prepare_weights([("moe_experts", case[4]), ("moe_experts", case[5]), ("linear", case[6]),
                             ("linear", case[7])])
        for _ in range(2):
            nat.moe_sublayer(*case, 4, 1.5, "sqrtsoftplus", 10.0)
        assert calls[-1]["packed_experts"] is not None and calls[-1]["packed_shared"][0] is not None


@pytest.mark.parametrize("T", [2, 20, 33])  # one partial tile of tokens, more than one
def test_grouped_amx_bf16(nat, T):
    x, w = make((T, 4, 512), torch.bfloat16), make((4, 128, 512), torch.bfloat16, 1)
    want = torch.einsum("tgk,gnk->tgn", x.double(), w.double()).to(torch.bfloat16)
    assert_close(nat.grouped_linear(x, w), want)  # AMX tiles where available, else oneDNN
    assert native.grouped_amx_bf16(nat.native_library, x[:, :, :70], make((4, 128, 70), torch.bfloat16)) is None
    assert native.grouped_amx_bf16(nat.native_library, x, w[:, :96]) is None  # rows not a multiple of 64
    if not nat.native_amx:  # without AMX the tile entry point declines everything
        assert native.grouped_amx_bf16(nat.native_library, x, w) is None


def require_amx(nat):
    if not nat.native_amx:
        pytest.skip("no usable AMX here (CPU, compiler, build switch or kernel permission): the AMX tile path "
                    "is not tested on this machine")


@pytest.mark.parametrize("T", [2, 20, 33])
def test_grouped_amx_bf16_tiles(nat, T):
    require_amx(nat)
    x, w = make((T, 4, 512), torch.bfloat16), make((4, 128, 512), torch.bfloat16, 1)
    want = torch.einsum("tgk,gnk->tgn", x.double(), w.double()).to(torch.bfloat16)
    assert_close(native.grouped_amx_bf16(nat.native_library, x, w), want)


@pytest.mark.parametrize("rows", [2, 17, 64])
def test_linear_amx_bf16(nat, rows):
    x, w = make((rows, 96), torch.bfloat16), make((192, 96), torch.bfloat16, 1)
    want = (x.double() @ w.double().t()).to(torch.bfloat16)
    assert_close(nat.linear(x.view(1, rows, 96), w).view(rows, 192), want)  # AMX tiles where available
    assert native.linear_amx_bf16(nat.native_library, x, w[:100]) is None  # rows not a multiple of 64
    assert native.linear_amx_bf16(nat.native_library, x[:, :70], make((192, 70), torch.bfloat16)) is None
    if not nat.native_amx:
        assert native.linear_amx_bf16(nat.native_library, x, w) is None


@pytest.mark.parametrize("rows", [2, 17, 64])
def test_linear_amx_bf16_tiles(nat, rows):
    require_amx(nat)
    x, w = make((rows, 96), torch.bfloat16), make((192, 96), torch.bfloat16, 1)
    want = (x.double() @ w.double().t()).to(torch.bfloat16)
    assert_close(native.linear_amx_bf16(nat.native_library, x, w), want)


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 32, 33, 64])
def test_decode_batch_linears_take_amx_where_it_is_fastest(rows):
    """With AMX (the "amx" tuning): the register tiles up to 6 rows, AMX's tiles from 7 to 32, oneDNN's packed
    copy above (each where it measured fastest), on weights given at load."""
    kernels = NativeCpuKernels()
    require_amx(kernels)
    lib, (low, high) = kernels.native_library, kernels.tuning.packed_gemm_rows
    w, x = make((192, 96), torch.bfloat16), make((rows, 96), torch.bfloat16, 1)
    kernels.prepare_weights([("linear", w)])
    if low <= rows <= high:
        want = native.packed_linear_bf16(lib, x, kernels.tile_weights.lookup(w), w.shape)
    elif rows <= kernels.tuning.linear_amx_max_rows:
        want = native.linear_amx_bf16(lib, x, w)
    else:
        want = packed_weights.linear(x, kernels.packed_weights.lookup(w))
    assert (low, high) == (1, 6) and torch.equal(kernels.linear(x, w), want)


@pytest.mark.parametrize("G,N,K", [(4, 256, 512), (3, 20, 70)])  # model size; tails of rows and of K
def test_grouped_gemv_bf16(nat, G, N, K):
    x, w = make((1, G, K), torch.bfloat16), make((G, N, K), torch.bfloat16, 1)
    want = torch.stack([(w[i].double() @ x[0, i].double()) for i in range(G)]).to(torch.bfloat16).unsqueeze(0)
    assert_close(nat.grouped_linear(x, w), want)
    assert native.grouped_gemv_bf16(nat.native_library, make((2, G, K), torch.bfloat16), w) is None  # 2 tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,H,d,L", [(32, 1, 16, 128, 200), (3, 2, 4, 32, 21), (2, 3, 20, 64, 7)])
def test_sink_attention_decode(nat, B, S, H, d, L, dtype):
    # model size; the tiny model's 4 heads (a partly filled lane set); 20 heads (a full set and a part)
    g = torch.Generator().manual_seed(B * 100 + L)
    q, kv = make((B, S, H, d), dtype, 1), make((B, L, d), dtype, 2)
    mask = torch.rand(B, S, L, generator=g) > 0.4
    mask[-1, 0] = False  # a query that sees no key: output 0
    sinks = torch.randn(H, generator=g)
    # exact reference: fp64 softmax over the visible keys and the sink
    logits = torch.einsum("bshd,bld->bshl", q.double(), kv.double()) * d ** -0.5
    logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
    full = torch.cat((logits, sinks.double().view(1, 1, H, 1).expand(B, S, H, 1)), dim=-1)
    want = torch.einsum("bshl,bld->bshd", torch.softmax(full, -1)[..., :L], kv.double()).to(dtype)
    got = nat.sink_attention(q, kv, mask, sinks, d ** -0.5)
    assert_close(got, want)
    assert (got[-1, 0] == 0).all()
    if dtype == torch.float32:  # and the pure-torch kernel (bf16 rounds its fp32 result the same way)
        assert_close(got, REF.sink_attention(q, kv, mask, sinks, d ** -0.5))
    assert native.sink_attention_decode(nat.native_library, q, kv.float() if dtype != torch.float32 else kv.double(),
                                        mask, sinks, 1.0) is None  # kv of another dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,d,parts", [(3, 4, 32, (7, 5)), (2, 20, 64, (9,)), (4, 16, 128, (12, 0))])
def test_sink_attention_rows(nat, B, H, d, parts, dtype):
    # keys read by index from one or two caches (a decode step's window ring and compressed entries)
    # are the same keys, order and arithmetic as the C attention over the gathered, concatenated keys
    g = torch.Generator().manual_seed(B * 10 + H)
    q, sinks = make((B, 1, H, d), dtype, 1), torch.randn(H, generator=g)
    caches = tuple(make((30 + i, d), dtype, 2 + i) for i in range(len(parts)))
    rows = tuple(torch.randint(0, c.shape[0], (B, L), generator=g) for c, L in zip(caches, parts))
    masks = tuple(torch.rand(B, 1, L, generator=g) > 0.3 for L in parts)
    masks[0][-1] = False  # the last query sees only its compressed entries (or nothing)
    got = nat.sink_attention_rows(q, caches, rows, masks, sinks, d ** -0.5)
    kv = torch.cat([c[r] for c, r in zip(caches, rows)], dim=1)
    mask = torch.cat(masks, dim=2)
    assert torch.equal(got, nat.sink_attention(q, kv, mask, sinks, d ** -0.5))
    # exact reference: fp64 softmax over the visible keys and the sink
    logits = torch.einsum("bshd,bld->bshl", q.double(), kv.double()) * d ** -0.5
    logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
    full = torch.cat((logits, sinks.double().view(1, 1, H, 1).expand(B, 1, H, 1)), dim=-1)
    want = torch.einsum("bshl,bld->bshd", torch.softmax(full, -1)[..., :kv.shape[1]], kv.double()).to(dtype)
    assert_close(got, want)
    bad = (rows[0].clone().fill_(caches[0].shape[0]),) + rows[1:]
    with pytest.raises(IndexError, match="outside its cache"):
        nat.sink_attention_rows(q, caches, bad, masks, sinks, d ** -0.5)
    # another dtype of cache: the composed default (None from the C wrapper)
    assert native.sink_attention_rows(nat.native_library, q, tuple(c.double() for c in caches), rows, masks, sinks,
                                      1.0) is None


# ----- build switches and instruction-set tiers -----
# What each DEEPINFER_CPU_NATIVE_ISA switch must leave out of the build (native.build_isa names).
SWITCHED_OFF = {"native": set(), "no-amx": {"amx"}, "no-avx512bf16": {"avx512bf16", "amx"},
                "no-avx512": {"avx512f", "avx512bf16", "amx"},
                "no-avx2": {"avx2", "fma", "avx512f", "avx512bf16", "amx"}}


def cpu_flags() -> set[str] | None:
    """This CPU's /proc/cpuinfo flags (Linux), or None where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None


def cpu_isa() -> set[str] | None:
    """This CPU's features under build_isa's names (Linux), or None where /proc/cpuinfo is missing."""
    flags = cpu_flags()
    if flags is None:
        return None
    have = {name for name, flag in [("avx2", "avx2"), ("fma", "fma"), ("avx512f", "avx512f"),
                                    ("avx512bf16", "avx512_bf16")] if flag in flags}
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        have.add("amx")
    return have


def test_gemv_tier_follows_the_build(nat):
    # the decode GEMV runs the best tier the library was compiled for, and `deepinfer doctor` (the
    # probe, which compiles nothing) predicts that build from the CPU's flags and the switch
    built = native.build_isa(nat.native_library)
    assert native.gemv_tier(nat.native_library) == native.gemv_tier_for(built)
    if cpu_isa() is not None:
        assert native.planned_isa() == built
    reason = CpuAccelerator.probe().reason
    assert f"C decode kernels: {native.gemv_tier_for(built)}" in reason, reason
    assert f"-march={native.planned_target()})" in reason, reason
    assert native.gemv_tier_for(frozenset({"avx2"})) == "portable"  # AVX2 without FMA: the plain loops


def test_switch_names_are_checked(monkeypatch):
    assert set(SWITCHED_OFF) == set(native.BUILD_VARIANTS) == set(native.SWITCHED_OFF)
    assert {k: set(v) for k, v in native.SWITCHED_OFF.items()} == SWITCHED_OFF
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "no-avx512")
    assert native.build_variant() == "no-avx512" and "-DDEEPINFER_NO_AVX512" in native.build_flags()
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "avx1024")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_NATIVE_ISA"):
        native.build_variant()


# /proc/cpuinfo flags: an AVX-512 server (x86-64-v4 and more), an AVX2 CPU, that CPU in a VM that
# hides MOVBE, and a VM's CPU without SSE4.2 / POPCNT (qemu64)
V2 = "fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"
V3 = V2 + " avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
AVX512_SERVER = V3 + " avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16 vaes gfni avx_vnni"
NO_MOVBE = V3.replace(" movbe", "")
QEMU64 = "fpu sse sse2 pni cx16 lahf_lm"


def march(flags: tuple[str, ...]) -> list[str]:
    return [f for f in flags if f.startswith("-march=")]


@pytest.mark.parametrize("cpu", [AVX512_SERVER, V3], ids=["avx512-server", "avx2-cpu"])
def test_lower_switches_compile_what_a_cpu_of_that_tier_builds(monkeypatch, cpu):
    # no-avx512 is an AVX2 CPU's build (x86-64-v3), no-avx2 a CPU's without AVX2 (x86-64-v2): not this
    # CPU with a feature masked off, which keeps its other extensions (VAES, GFNI, AVX-VNNI) and tuning
    monkeypatch.setattr(native.build, "_cpuinfo_flags", lambda: cpu, raising=False)
    assert march(native.build_flags("no-avx512")) == ["-march=x86-64-v3"]
    assert march(native.build_flags("no-avx2")) == ["-march=x86-64-v2"]
    for variant in ("native", "no-amx", "no-avx512bf16"):  # the CPU's own build, less what the switch removes
        assert march(native.build_flags(variant)) == ["-march=native"]
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "no-avx512")
    assert native.planned_target() == "x86-64-v3"
    assert native.planned_isa() == {"avx2", "fma"}  # what the x86-64-v3 build compiles (build_isa's names)
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "no-avx2")
    assert native.planned_target() == "x86-64-v2" and native.planned_isa() == frozenset()


@pytest.mark.parametrize("variant, cpu", [("no-avx512", NO_MOVBE), ("no-avx512", None), ("no-avx2", QEMU64),
                                          ("no-avx2", None)], ids=["v3-without-movbe", "v3-unknown", "qemu64",
                                                                   "v2-unknown"])
def test_a_cpu_below_the_switch_level_builds_for_itself(monkeypatch, variant, cpu):
    # x86-64-v3 / v2 could hold instructions this CPU lacks (SIGILL): there, and where the CPU's flags
    # are unknown, the switch masks its instruction sets off this CPU's own build, as before
    monkeypatch.setattr(native.build, "_cpuinfo_flags", lambda: cpu, raising=False)
    flags = native.build_flags(variant)
    assert march(flags) == ["-march=native"]
    assert {"-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-DDEEPINFER_NO_AVX512"} <= set(flags)
    assert ({"-mno-avx2", "-mno-fma"} <= set(flags)) == (variant == "no-avx2")


def predefined_macros(flags: tuple[str, ...]) -> set[str]:
    """What the compiler predefines with `flags` (the instruction sets, the tuning), `-D`s left out."""
    out = subprocess.run([*native._compiler(), *(f for f in flags if not f.startswith("-D")), "-dM", "-E", "-x", "c",
                          "/dev/null"], capture_output=True, text=True, check=True)
    return set(out.stdout.splitlines())


@pytest.mark.parametrize("variant, level", [("no-avx512", "x86-64-v3"), ("no-avx2", "x86-64-v2")])
def test_the_emulated_tier_compiles_exactly_the_level(variant, level):
    # the compiler sees the level and nothing of this CPU's: the same predefined macros (extensions,
    # tuning) as a plain -march=<level> build; on a CPU below the level the switch builds for it instead
    have = cpu_flags()
    if have is None or not set({"x86-64-v3": V3, "x86-64-v2": V2}[level].split()) <= have:
        pytest.skip(f"this CPU lacks part of {level}: the {variant} switch builds for the CPU itself here")
    assert predefined_macros(native.build_flags(variant)) == predefined_macros(native.FLAGS + (f"-march={level}",))


@pytest.mark.slow
def test_switch_is_part_of_the_cache_key(monkeypatch, tmp_path, compile_once):
    # DEEPINFER_CPU_NATIVE_ISA reaches the compiler: each switch builds (and finds) its own library
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "native")
    default = native._build()
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_ISA", "no-avx512")
    switched = native._build()
    assert switched != default and switched.exists() and default.exists()
    assert not native.build_isa(native._load(switched)) & SWITCHED_OFF["no-avx512"]


def test_build_matches_the_cpu_and_the_switch(nat):
    # never an instruction the CPU lacks (the key includes the CPU), never one the switch removed,
    # and the AVX2/FMA paths wherever the CPU has them and the switch keeps them
    have = cpu_isa()
    if have is None:
        pytest.skip("no /proc/cpuinfo: the CPU's features are unknown here")
    built = native.build_isa(nat.native_library)
    assert built <= have, f"built for {sorted(built - have)}, which this CPU lacks"
    off = SWITCHED_OFF[native.build_variant()]
    assert not built & off
    assert ({"avx2", "fma"} & have) - off <= built


@pytest.mark.parametrize("tier", ["avx512f", "avx512bf16", "amx"])
def test_tier_is_compiled_where_the_cpu_has_it(nat, tier):
    # on a CPU with the feature, -march=native must compile its path (else the tests above only
    # covered the portable code); a gcc/clang too old to know the feature fails here
    have = cpu_isa()
    if have is None or tier not in have:
        pytest.skip(f"this CPU has no {tier}: its code path is not tested on this machine")
    if tier in SWITCHED_OFF[native.build_variant()]:
        pytest.skip(f"DEEPINFER_CPU_NATIVE_ISA={native.build_variant()} switches {tier} off")
    assert tier in native.build_isa(nat.native_library)


@pytest.fixture(scope="module")
def switch_builds(tmp_path_factory, once_compiler):
    """Each build switch compiled (into a private temporary folder) and loaded."""
    folder = tmp_path_factory.mktemp("switches")
    libs = {}
    for variant in native.BUILD_VARIANTS:
        path = folder / f"kernels-{variant}.so"
        native._compile(path, once_compiler, native.build_flags(variant))
        libs[variant] = native._load(path)
    return libs


@pytest.mark.parametrize("variant", ["no-amx", "no-avx512bf16", "no-avx512", "no-avx2"])
@pytest.mark.slow
def test_switch_build(switch_builds, variant):
    # what the switch removes is gone (also where the CPU never had it), what the CPU has below it
    # stays, and every kernel of that build agrees with the references
    lib = switch_builds[variant]
    built = native.build_isa(lib)
    assert not built & SWITCHED_OFF[variant]
    have = cpu_isa()
    if have is not None:
        assert built == native.build_isa(switch_builds["native"]) - SWITCHED_OFF[variant]
        assert {"avx2", "fma"} & have - SWITCHED_OFF[variant] <= built
    check_every_kernel(lib)


def check_attention_layer(lib):
    """The two fused attention calls of one bf16 token (plain weights: the GEMVs) are the bits of the
    same library's kernels called one by one (tests/test_cpu_attention_layer.py: the tiles, the model)."""
    g = torch.Generator().manual_seed(3)
    x, fused_x, fused_qr = make((1, 96), torch.bfloat16), make((48 + 64 + 8, 96), torch.bfloat16, 1) * 0.1, \
        make((2 * 64 + 2 * 32, 48), torch.bfloat16, 2) * 0.2
    q_norm, kv_norm = torch.rand(48, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5
    angles = make((1, 8), torch.float32, 3)
    cs = (angles.cos(), angles.sin())
    px, q, kv, iq = native.run(lib, native.attention_projections_arguments(lib, x, fused_x, 48, q_norm, fused_qr, 2,
                                                                           kv_norm, 1e-6, *cs, 2, *cs, None, None))
    assert torch.equal(px, native.run(lib, native.gemv_bf16_arguments(lib, fused_x, x)).view(1, -1))
    normed = native.run(lib, native.rms_norm_arguments(lib, px[:, :48], q_norm, 1e-6))
    pqr = native.run(lib, native.gemv_bf16_arguments(lib, fused_qr, normed)).view(1, -1)
    assert torch.equal(q, native.rms_norm_rotary(lib, pqr[:, :128].reshape(1, 2, 64), None, 1e-6, *cs))
    assert torch.equal(kv, native.rms_norm_rotary(lib, px[:, 48:112], kv_norm, 1e-6, *cs))
    assert torch.equal(iq, native.rotary(lib, pqr[:, 128:].reshape(1, 2, 32), *cs, False))
    window, entries = make((10, 64), torch.bfloat16, 4), make((6, 64), torch.bfloat16, 5)
    sinks = torch.randn(2, generator=g)
    rows, masks = (torch.tensor([[1, 4, 7]]), torch.tensor([[0, 5]])), (torch.ones(1, 1, 3, dtype=torch.bool),) * 2
    wo_a, wo_b = make((2, 16, 64), torch.bfloat16, 6) * 0.2, make((40, 32), torch.bfloat16, 7) * 0.2
    caches = (window.clone(), entries)
    got = native.attention_output(lib, q, kv, torch.tensor([7]), caches, rows, (masks[0], masks[1][..., :2]),
                                  sinks, 0.125, *cs, wo_a, wo_b, None, None)
    window[7] = kv[0]
    assert torch.equal(caches[0], window)
    o = native.sink_attention_rows(lib, q.unsqueeze(1), (window, entries), rows, (masks[0], masks[1][..., :2]),
                                   sinks, 0.125).squeeze(1)
    o = native.grouped_gemv_bf16(lib, native.rotary(lib, o, *cs, True).view(1, 2, 64), wo_a)
    assert torch.equal(got, native.run(lib, native.gemv_bf16_arguments(lib, wo_b, o.reshape(1, -1))).view(1, -1))


def check_every_kernel(lib):
    """One or two cases of each C kernel of `lib` against the fp64 or plain-torch references."""
    assert not native.amx_usable(lib)
    for dtype in DTYPES:
        x = make((17, 256), dtype)
        for weight in (None, make((256,), torch.float32, 1)):
            assert_close(native.run(lib, native.rms_norm_arguments(lib, x, weight, 1e-6)),
                         REF.rms_norm(x, weight, 1e-6))
        angles = make((17, 8), torch.float32, 5) * 3
        xr = make((17, 6, 64), dtype, 1)
        for inverse in (False, True):
            assert_close(native.rotary(lib, xr, angles.cos(), angles.sin(), inverse),
                         REF.rotary(xr, angles.cos(), angles.sin(), inverse))
        normed = native.run(lib, native.rms_norm_arguments(lib, xr, None, 1e-6))
        assert_close(native.rms_norm_rotary(lib, xr, None, 1e-6, angles.cos(), angles.sin()),
                     REF.rotary(normed, angles.cos(), angles.sin(), False))
        streams = make((17, 4, 64), dtype)
        fn = make((24, 256), torch.float32, 1) * 0.1
        base, scale = make((24,), torch.float32, 2), make((3,), torch.float32, 3).abs() + 0.5
        want = REF.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        for fn_t in (native.transpose_fn(fn), None):  # the 4-row tiles on fn transposed, then on fn
            got = native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, 20, 1e-6, 1e-6, fn_t=fn_t))
            assert_close(got[0], want[0])
            for g, w in zip(got[1:], want[1:]):
                assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
        norm = make((64,), torch.float32, 4)
        assert_close(native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, 20, 1e-6, 1e-6, norm,
                                                             1e-5))[0],
                     REF.rms_norm(got[0], norm, 1e-5))
        ring = [torch.zeros(8, 64) for _ in range(2)]
        assert native.compress_store(lib, y := make((2, 64), dtype, 7), y, make((4, 64), torch.float32, 8),
                                     torch.tensor([1, 3]), torch.tensor([6, 2]), *ring)
        assert torch.equal(ring[0][[6, 2]], y.float())
        head_fn, head_base = make((4, 256), torch.float32, 5) * 0.1, make((4,), torch.float32, 6)
        assert_close(native.hc_head(lib, streams, head_fn, head_base, scale[:1], 1e-6, 1e-6),
                     hc_head_exact(streams, head_fn, head_base, scale[:1], 1e-6, 1e-6))
        y = make((17, 64), dtype, 4)
        assert_close(native.hc_post(lib, y, streams, want[1], want[2]), REF.hc_post(y, streams, want[1], want[2]))
        post3, comb3 = want[1][:, :3].contiguous(), want[2][:, :3, :3].contiguous()  # n = 3: the general loop
        for T in (1, 17):
            check_hc_post_pre_norm(lib, T, 4, 64, dtype, dtype, torch.bfloat16, T >= 4)
        assert_close(native.hc_post(lib, y, streams[:, :3], post3, comb3), REF.hc_post(y, streams[:, :3], post3, comb3))
        gate_up = make((17, 512), dtype) * 6
        assert_close(native.swiglu(lib, gate_up[:, :256], gate_up[:, 256:], 10.0),
                     REF.swiglu(gate_up[:, :256].float(), gate_up[:, 256:].float(), 10.0).to(dtype))
        q, kv = make((3, 2, 20, 64), dtype, 1), make((3, 21, 64), dtype, 2)
        mask = torch.rand(3, 2, 21, generator=torch.Generator().manual_seed(1)) > 0.4
        sinks = make((20,), torch.float32, 3)
        logits = torch.einsum("bshd,bld->bshl", q.double(), kv.double()).mul(0.125)
        logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
        full = torch.cat((logits, sinks.double().view(1, 1, 20, 1).expand(3, 2, 20, 1)), dim=-1)
        exact = torch.einsum("bshl,bld->bshd", torch.softmax(full, -1)[..., :21], kv.double()).to(dtype)
        assert_close(native.sink_attention_decode(lib, q, kv, mask, sinks, 0.125), exact)
        # a head's bits do not depend on how many heads share its vectors (AVX2 runs up to 8 heads on 8
        # lanes, more on 16): 4 heads alone, and the same 4 heads among 12, against fp64 too
        few = native.sink_attention_decode(lib, q[:, :, :4].contiguous(), kv, mask, sinks[:4], 0.125)
        assert_close(few, exact[:, :, :4])
        assert torch.equal(few, native.sink_attention_decode(lib, q[:, :, :12].contiguous(), kv, mask, sinks[:12],
                                                             0.125)[:, :, :4])
        ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:3] for t in range(5)])
        rows, counts, source_token, source_slot = native.moe_dispatch_rows(lib, x[:5], ids, 8)
        _, plan = REF.moe_dispatch(x[:5], ids, 8)
        assert torch.equal(rows, x[:5].index_select(0, plan.source_token))
        assert torch.equal(counts, plan.tokens_per_expert) and torch.equal(source_token, plan.source_token)
        w = torch.rand(5, 3, generator=torch.Generator().manual_seed(2))
        assert torch.allclose(native.moe_combine_rows(lib, rows, source_token, source_slot, w),
                              REF.moe_combine(rows, plan, w), rtol=1e-5, atol=1e-5)
        check_indexer_scores(lib, dtype, 2, 1, 8, 64, 37)
    x = torch.linspace(-120, 120, 20_001).view(-1, 1)  # the vectorised exp, saturated tails included
    both = torch.cat((x, torch.ones_like(x)), dim=1)
    silu = native.swiglu(lib, both[:, :1], both[:, 1:], 0.0).double()
    assert ((silu - x.double() * torch.sigmoid(x.double())).abs() <= 1e-6 * silu.abs() + 1e-30).all()
    scores = torch.rand(3, 16, generator=torch.Generator().manual_seed(4))
    weights, ids = native.moe_route_rows(lib, scores, torch.zeros(16), 4, 1.5, None)
    want_w, want_ids = route_exact(scores, None, 4, 1.5, None)
    assert torch.equal(ids, want_ids) and torch.allclose(weights.double(), want_w, rtol=1e-6, atol=0)
    assert native.gemv_tier(lib) == native.gemv_tier_for(native.build_isa(lib))
    for T, D, E, k, inter, shared_inter, hashed, scoring in MOE_CASES[:2]:
        case = moe_case(T, D, E, k, inter, shared_inter, hashed)
        assert_close(native.moe_layer_bf16(lib, *case, k, 1.5, scoring, 10.0),
                     moe_sublayer_exact(*case, k, 1.5, scoring, 10.0))
    for N, K in [(7, 70), (100, 384), (9, 33), (5, 8), (4099, 64)]:  # with and without a K tail, short rows
        W, v = make((N, K), torch.bfloat16), make((K,), torch.bfloat16, 1)
        assert_close(native.run(lib, native.gemv_bf16_arguments(lib, W, v)),
                     (W.double() @ v.double()).to(torch.bfloat16))
    W, X = make((37, 70), torch.bfloat16), make((6, 70), torch.bfloat16, 1)
    assert_close(native.gemv_tokens_bf16(lib, X, W), (X.double() @ W.double().t()).to(torch.bfloat16))
    for M, N, K in [(1, 37, 70), (7, 100, 33), (65, 21, 64)]:  # the packed tiles and their tails
        check_packed_gemm(lib, M, N, K)
    xg, wg = make((1, 3, 70), torch.bfloat16), make((3, 20, 70), torch.bfloat16, 1)
    want = torch.stack([wg[i].double() @ xg[0, i].double() for i in range(3)]).to(torch.bfloat16).unsqueeze(0)
    assert_close(native.grouped_gemv_bf16(lib, xg, wg), want)
    check_attention_layer(lib)
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 4
    logits[0, 3] = logits[0, 900] = 50.0
    index, log_norm = native.argmax_logsumexp(lib, logits)
    assert torch.equal(index, logits.argmax(-1))
    assert torch.allclose(log_norm, torch.logsumexp(logits, -1), rtol=2e-6, atol=0)
    assert native.grouped_amx_bf16(lib, make((2, 4, 512), torch.bfloat16), make((4, 128, 512), torch.bfloat16)) is None
    assert native.linear_amx_bf16(lib, make((4, 64), torch.bfloat16), make((128, 64), torch.bfloat16)) is None
    for counts, D, inter in EXPERT_CASES:  # the dot-product expert path, also at AMX-friendly sizes
        E, n = len(counts), sum(counts)
        rows, w13, w2 = make((n, D), torch.bfloat16), make((E, 2 * inter, D), torch.bfloat16, 1), \
            make((E, D, inter), torch.bfloat16, 2)
        for limit in (10.0, 0.0):
            assert_close(native.experts_bf16(lib, rows, torch.tensor(counts), w13, w2, limit),
                         experts_reference(rows, counts, w13, w2, limit))
