"""DeepSeek-V4.1's op table on the cpu back end (`CpuDeepseekV41Ops`: single-pass mHC sites, the MXFP4
indexer, the decode attention over the FP8 window and NVFP4 entries) against
the plain-torch defaults (`DeepseekV41Ops`), and its C kernels (kv_cache.c, indexer.c, attention.c's
coded keys, mhc.c's sites) on this CPU's build and on the portable one (DEEPINFER_CPU_NATIVE_ISA=no-avx2).

Tolerances: the cache codecs are exact (kv_quant.py's bytes), and so are the indexer's picks and pool
(its scores are sums of exact products of MXFP4 values: the same in any order while they stay below
2**24 ulps; the test data keep them so). The mHC coefficients and the attention reduce in fp32 in
another order than torch: fp32 results within 1e-5 of the tensor's scale, bf16 within one ulp
(tests/test_cpu_native.py's assert_close). A fused call is the bits of its parts called one by one."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, MXFP4_INDEX, NVFP4_COMPRESSED, decode, encode
from deepinfer.models.deepseek_v41.ops import CandidateBlocks, DeepseekV41Ops
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels
from deepinfer_plugins.cpu.ops_v41 import CpuDeepseekV41Ops
from test_cpu_native import DTYPES, assert_close, make

DEFAULT = DeepseekV41Ops()


@pytest.fixture(scope="module")
def kernels() -> NativeCpuKernels:
    k = NativeCpuKernels()
    if k.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    return k


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The library as DEEPINFER_CPU_NATIVE_ISA=no-avx2 builds it (plain C, no AVX2 or FMA)."""
    path = tmp_path_factory.mktemp("portable") / "kernels-no-avx2.so"
    native._compile(path, native._compiler(), native.build_flags("no-avx2"))
    lib = native._load(path)
    assert not native.build_isa(lib) & {"avx2", "fma", "avx512f"}
    return lib


def keys_with_edges(N: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows of mixed magnitudes, with a zero row, a tiny row, exact grid values and ties."""
    x = make((N, C), torch.float32, seed) * torch.logspace(-3, 2, N).unsqueeze(1)
    x[0] = 0
    x[1] = 1e-30
    x[2, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])  # E2M1 rounding ties
    return x.to(dtype)


# ----- codecs -----

def check_kv_store(lib) -> None:
    for fmt in (FP8_WINDOW, NVFP4_COMPRESSED, MXFP4_INDEX):
        for dtype in DTYPES:
            for C in (64, 40):  # whole blocks, a partial last block
                x = keys_with_edges(12, C, dtype, 1)
                cache = torch.zeros(20, fmt.bytes_per_vector(C), dtype=torch.uint8)
                dest = torch.tensor([3, 0, 19, 7, 5, 1, 2, 4, 6, 8, 9, 10])
                assert native.kv_store(lib, x, fmt, cache, dest)
                want = torch.zeros_like(cache)
                want[dest] = encode(x, fmt)
                assert torch.equal(cache, want), f"{fmt.name} {dtype} C={C}"
            # rows as a column slice of a wider tensor (the projections' output)
            wide = keys_with_edges(5, 96, torch.bfloat16, 2)
            cache = torch.zeros(5, fmt.bytes_per_vector(64), dtype=torch.uint8)
            assert native.kv_store(lib, wide[:, 16:80], fmt, cache, torch.arange(5))
            assert torch.equal(cache, encode(wide[:, 16:80], fmt))
    cache = torch.zeros(4, FP8_WINDOW.bytes_per_vector(64), dtype=torch.uint8)
    assert not native.kv_store(lib, make((2, 64), torch.float16), FP8_WINDOW, cache, torch.tensor([0, 1]))
    assert not native.kv_store(lib, make((2, 64), torch.float32), FP8_WINDOW, cache[:, :-1].contiguous(),
                               torch.tensor([0, 1]))
    with pytest.raises(IndexError, match="outside the cache"):
        native.kv_store(lib, make((2, 64), torch.float32), FP8_WINDOW, cache, torch.tensor([0, 4]))


def test_kv_store_is_encode(kernels):
    check_kv_store(kernels.native_library)


def test_kv_store_is_encode_portable(portable):
    check_kv_store(portable)


@pytest.mark.parametrize("fmt", [NVFP4_COMPRESSED, MXFP4_INDEX])
def test_cache_store_writes_the_defaults_bytes(kernels, fmt):
    """The op table's `cache_store` (a compressor's entries and index keys) writes the default's bytes, on
    bf16 and fp32 rows, and leaves the other rows alone; a layout the C code does not take (fp16) falls back."""
    ours, default = CpuDeepseekV41Ops(kernels), DeepseekV41Ops(kernels)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = keys_with_edges(6, 64, dtype, 3)
        rows = torch.tensor([4, 0, 9, 2, 7, 5])
        caches = [torch.full((10, fmt.bytes_per_vector(64)), 0xA5, dtype=torch.uint8) for _ in range(2)]
        ours.cache_store(x, fmt, caches[0], rows)
        default.cache_store(x, fmt, caches[1], rows)
        assert torch.equal(caches[0], caches[1]), f"{fmt.name} {dtype}"
        assert (caches[0][[1, 3, 6, 8]] == 0xA5).all()


def check_coded_attention(lib) -> None:
    """Attention over FP8 window rows and NVFP4 entry rows, decoded as they are read, is the bits of the same
    C attention over the keys kv_quant.decode gives."""
    B, H, d = 3, 6, 64
    for dtype in DTYPES:
        q = make((B, 1, H, d), dtype, 1)
        window = encode(keys_with_edges(10, d, torch.float32, 3), FP8_WINDOW)
        entries = encode(keys_with_edges(9, d, torch.float32, 4), NVFP4_COMPRESSED)
        rows = (torch.tensor([[0, 4, 7, 9], [1, 2, 3, 5], [6, 8, 0, 1]]), torch.tensor([[2, 5], [0, 8], [1, 3]]))
        g = torch.Generator().manual_seed(5)
        masks = (torch.rand(B, 1, 4, generator=g) > 0.3, torch.rand(B, 1, 2, generator=g) > 0.3)
        sinks = make((H,), torch.float32, 6)
        got = native.sink_attention_rows(lib, q, (window, entries), rows, masks, sinks, 0.125,
                                         (FP8_WINDOW, NVFP4_COMPRESSED))
        plain = (decode(window, FP8_WINDOW, d, dtype), decode(entries, NVFP4_COMPRESSED, d, dtype))
        assert torch.equal(got, native.sink_attention_rows(lib, q, plain, rows, masks, sinks, 0.125))
        one = native.sink_attention_rows(lib, q, (window,), rows[:1], masks[:1], sinks, 0.125, (FP8_WINDOW,))
        assert torch.equal(one, native.sink_attention_rows(lib, q, plain[:1], rows[:1], masks[:1], sinks, 0.125))


def test_coded_attention_is_decoded_attention(kernels):
    check_coded_attention(kernels.native_library)


def test_coded_attention_is_decoded_attention_portable(portable):
    check_coded_attention(portable)


# ----- the indexer -----

def index_case(B: int, S: int, E: int, dtype: torch.dtype, ties: bool, seed: int = 0, Hi: int = 4):
    di = 64
    q = make((B, S, Hi, di), dtype, seed)
    weights = make((B, S, Hi), dtype, seed + 1)
    keys = keys_with_edges(3 * max(E, 1), di, torch.float32, seed + 2)
    if ties:  # equal keys: equal scores, the older entry first
        keys[1::2] = keys[0::2][:keys[1::2].shape[0]]
    index_keys = encode(keys, MXFP4_INDEX)
    rows = torch.stack([torch.randperm(3 * max(E, 1), generator=torch.Generator().manual_seed(seed + b))[:E]
                        for b in range(B)])
    if ties:
        rows = torch.arange(E).repeat(B, 1)
    positions = torch.tensor([[4 * E - 1 - 3 * s - b for s in range(S)] for b in range(B)])
    visible = torch.arange(E) < ((positions + 1) // 4).unsqueeze(-1)
    return q, weights, index_keys, rows, visible, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("B,S,E,k", [(1, 1, 37, 8), (3, 1, 40, 16), (2, 3, 20, 32), (2, 1, 0, 4)])
def test_index_select(kernels, dtype, ties, B, S, E, k):
    """The C indexer's picks, candidate pool and candidate-restricted picks are the default's."""
    ops = CpuDeepseekV41Ops(kernels)
    q, weights, index_keys, rows, visible, positions = index_case(B, S, E, dtype, ties)
    pool = CandidateBlocks(4, 3, 4, positions)
    for lib_ops in (ops, None):
        args = (q, weights, 0.0625, index_keys, rows, visible, k)
        want, want_pool = DEFAULT.index_select(*args, pool=pool)
        got, got_pool = (ops.index_select(*args, pool=pool) if lib_ops else
                         native.index_select(kernels.native_library, *args, None,
                                             (pool.size, pool.keep, pool.rate, pool.positions)))
        assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
        if E:
            want, _ = DEFAULT.index_select(*args, candidates=want_pool)
            assert torch.equal(ops.index_select(*args, candidates=want_pool)[0], want)


@pytest.mark.parametrize("Hi", [3, 17, 32, 33, 64, 100])
def test_index_select_sums_the_heads_in_the_defaults_order(kernels, Hi):
    """The picks stay the default's where the scores' head sum rounds: both add the heads pairwise in one
    fixed order (ops.py's _pairwise_head_sum). 20 queries of 32 heads and more over 50 entries pick
    differently when the heads are summed in another order (as torch's .sum does, by vector width)."""
    for dtype in DTYPES:
        for E in (1, 6, 50):
            g = torch.Generator().manual_seed(Hi * 7 + E)
            q = torch.randn(2, 20, Hi, 128, generator=g).to(dtype)
            weights = torch.randn(2, 20, Hi, generator=g).to(dtype)
            index_keys = encode(torch.randn(200, 128, generator=g), MXFP4_INDEX)
            rows = torch.randint(0, 200, (2, E), generator=g)
            args = (q, weights, 0.01, index_keys, rows, torch.ones(2, 20, E, dtype=torch.bool), min(16, E))
            assert torch.equal(native.index_select(kernels.native_library, *args, None, None)[0],
                               DEFAULT.index_select(*args)[0]), (dtype, E)


def test_index_select_portable(kernels, portable):
    for dtype in DTYPES:
        for ties in (False, True):
            q, weights, index_keys, rows, visible, positions = index_case(2, 2, 30, dtype, ties, 3)
            args = (q, weights, 0.0625, index_keys, rows, visible, 8)
            want, want_pool = DEFAULT.index_select(*args, pool=CandidateBlocks(4, 2, 4, positions))
            got, got_pool = native.index_select(portable, *args, None, (4, 2, 4, positions))
            assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


def test_index_select_rejects_a_row_outside_the_keys(kernels):
    q, weights, index_keys, rows, visible, _ = index_case(1, 1, 10, torch.float32, False)
    rows[0, 3] = index_keys.shape[0]
    with pytest.raises(IndexError, match="outside the index keys"):
        native.index_select(kernels.native_library, q, weights, 1.0, index_keys, rows, visible, 4, None, None)


# ----- single-pass mHC sites -----

def site_case(T: int, n: int, D: int, dtype: torch.dtype, w_dtype: torch.dtype):
    streams = make((T, n, D), dtype)
    pre_in = torch.sigmoid(make((T, n), torch.float32, 1)) + 1e-6
    fn = make((n * (n + 2), n * D), torch.float32, 2) * 0.05
    base, scale = make((n * (n + 2),), torch.float32, 3), make((3,), torch.float32, 4).abs() + 0.5
    return streams, pre_in, (fn, base, scale, 20, 1e-6, 1e-6, make((D,), w_dtype, 5), 1e-5)


def check_sites(lib, T: int, n: int, D: int, dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """hc_mix_collapse_norm is hc_pre_norm's coefficients of each row alone with the collapse on the given
    pre (the bits of hc_pre_norm of that row where pre_in is its own pre), near the torch default;
    hc_post_mix_collapse_norm is the bits of hc_post then hc_mix_collapse_norm, into new tensors and into
    given ones."""
    streams, pre_in, site = site_case(T, n, D, dtype, w_dtype)
    fn, base, scale, iters, eps, norm_eps, norm, rms_eps = site
    got = native.hc_mix_collapse_norm(lib, streams, pre_in, *site)
    own = [native.run(lib, native.hc_pre_arguments(lib, streams[t:t + 1], fn, base, scale, iters, eps, norm_eps, norm,
                                                   rms_eps))
           for t in range(T)]
    own = [torch.cat(parts) for parts in zip(*own)]
    assert torch.equal(got.post, own[1]) and torch.equal(got.comb, own[2])
    again = native.hc_mix_collapse_norm(lib, streams, got.pre, *site)
    assert torch.equal(again.normed, own[0]) and torch.equal(again.pre, got.pre)
    want = DEFAULT.hc_mix_collapse_norm(streams, pre_in, *site)
    # the collapse rounded to the streams' dtype, then the norm: compared on the default's collapse
    collapsed = DEFAULT.hc_collapse(streams, pre_in)
    assert_close(got.normed, native.run(lib, native.rms_norm_arguments(lib, collapsed, norm, rms_eps)))
    for g, w in zip((got.pre, got.post, got.comb), want[1:]):
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
    y, post, comb = make((T, D), dtype, 6), torch.rand(T, n) * 2, torch.softmax(make((T, n, n), torch.float32, 7),
                                                                                 dim=-1)
    mixed = native.hc_post(lib, y, streams, post, comb)
    want = (mixed, *native.hc_mix_collapse_norm(lib, mixed, pre_in, *site)[1:])
    for out in (None, native.site_outputs(T, n, D, dtype)):
        fused = native.run(lib, native.hc_post_mix_collapse_norm_arguments(y, streams, post, comb, pre_in, *site,
                                                                           out=out))
        assert out is None or all(f is o for f, o in zip(fused, out))
        for name, f, w in zip(native.SiteOutputs._fields, fused, want):
            assert torch.equal(f, w), f"{name} (T={T}, n={n}, {dtype})"
    # declined, not read out of bounds: pre_in of the wrong shape, an output set aliasing the input
    assert native.hc_mix_collapse_norm(lib, streams, pre_in[:, :-1], *site) is None
    out = native.site_outputs(T, n, D, dtype)
    assert native.hc_mix_collapse_norm(lib, streams, out.pre, *site, out=out) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_site_rows_do_not_depend_on_the_rows_beside_them(kernels, dtype):
    """Each row of a site call has the bits of that row called alone: a step split over context-parallel
    ranks (or chunked, or batched otherwise) gives the same values."""
    lib = kernels.native_library
    streams, pre_in, site = site_case(37, 4, 256, dtype, torch.bfloat16)
    y, post = make((37, 256), dtype, 6), torch.rand(37, 4) * 2
    comb = torch.softmax(make((37, 4, 4), torch.float32, 7), dim=-1)
    full = native.hc_mix_collapse_norm(lib, streams, pre_in, *site)
    fused = native.run(lib, native.hc_post_mix_collapse_norm_arguments(y, streams, post, comb, pre_in, *site))
    for t0, t1 in ((0, 1), (5, 6), (3, 20), (20, 37)):
        part = native.hc_mix_collapse_norm(lib, streams[t0:t1], pre_in[t0:t1], *site)
        for name in ("normed", "pre", "post", "comb"):
            assert torch.equal(getattr(part, name), getattr(full, name)[t0:t1]), (name, t0, t1)
        part = native.run(lib, native.hc_post_mix_collapse_norm_arguments(y[t0:t1], streams[t0:t1], post[t0:t1],
                                                                          comb[t0:t1], pre_in[t0:t1], *site))
        for name, p, f in zip(native.SiteOutputs._fields, part, fused):
            assert torch.equal(p, f[t0:t1]), (name, t0, t1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 4, 17, 70])
def test_sites(kernels, dtype, T):
    check_sites(kernels.native_library, T, 4, 160, dtype, torch.bfloat16)
    check_sites(kernels.native_library, T, 3, 64, dtype, torch.float32)


def test_sites_portable(portable):
    for dtype in DTYPES:
        for T in (1, 5, 17):
            check_sites(portable, T, 4, 64, dtype, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_site_chain_through_the_op_table(kernels, dtype):
    """A chain of sites through the op table (each call reading the one before's results, the buffers
    reused in turn) gives the bits of the C calls on fresh tensors, and stays near the plain-torch chain."""
    ops = CpuDeepseekV41Ops(kernels)
    T, n, D = 2, 4, 64
    streams, pre, site = site_case(T, n, D, dtype, torch.bfloat16)
    ref_pre = pre
    lib = kernels.native_library
    x, pre, post, comb = ops.hc_mix_collapse_norm(streams, pre, *site)
    first = native.hc_mix_collapse_norm(lib, streams, ref_pre, *site)  # .streams: the given ones
    assert torch.equal(x, first.normed) and torch.equal(pre, first.pre)
    held = []
    for i in range(4):
        y = make((T, D), dtype, 10 + i)
        streams, x, pre_next, post, comb = ops.hc_post_mix_collapse_norm(y, streams, post, comb, pre, *site)
        want = native.run(lib, native.hc_post_mix_collapse_norm_arguments(y, first.streams, first.post, first.comb,
                                                                          first.pre, *site))
        for name, g, w in zip(native.SiteOutputs._fields, (streams, x, pre_next, post, comb), want):
            assert torch.equal(g, w), f"{name} at call {i}"
        assert pre_next is not pre  # the input set is never written
        held.append(pre_next)
        pre, first = pre_next, want
    assert held[0] is held[2] and held[1] is held[3] and held[0] is not held[1]


# ----- the decode attention -----

def attention_case(dtype: torch.dtype, parts: int, B: int = 2):
    H, d, G, R, D = 4, 64, 2, 16, 48
    q, kv = make((B, H, d), dtype, 1), make((B, d), dtype, 2)
    window = encode(make((12, d), torch.float32, 3), FP8_WINDOW)
    entries = encode(make((9, d), torch.float32, 4) * 2, NVFP4_COMPRESSED)
    key_rows = torch.tensor([7, 2, 11][:B])
    rows = (torch.tensor([[7, 1, 3, 0], [2, 5, 6, 9], [11, 10, 4, 8]][:B]),
            torch.tensor([[2, 5, 0], [0, 8, 1], [3, 4, 6]][:B]))
    g = torch.Generator().manual_seed(5)
    masks = (torch.rand(B, 1, 4, generator=g) > 0.2, torch.rand(B, 1, 3, generator=g) > 0.3)
    angles = make((B, 8), torch.float32, 6)
    wo_a, wo_b = make((G, R, H * d // G), dtype, 7) * 0.1, make((D, G * R), dtype, 8) * 0.1
    caches = (window, entries)[:parts]
    return q, kv, key_rows, caches, rows[:parts], masks[:parts], make((H,), torch.float32, 9), d ** -0.5, \
        angles.cos(), angles.sin(), wo_a, wo_b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("B", [1, 3])
def test_decode_attention_output(kernels, dtype, parts, B):
    """The C decode attention (fused call for bf16, else the coded-key store and attention in C) writes the
    default's FP8 codes into the ring and gives the bits of the default over the same kernels."""
    ops = CpuDeepseekV41Ops(kernels)
    q, kv, key_rows, caches, *rest = attention_case(dtype, parts, B)
    got_caches = tuple(c.clone() for c in caches)
    got = ops.decode_attention_output(q, kv, key_rows, got_caches, *rest)
    want_caches = tuple(c.clone() for c in caches)
    want = DeepseekV41Ops(kernels).decode_attention_output(q, kv, key_rows, want_caches, *rest)
    assert all(torch.equal(g, w) for g, w in zip(got_caches, want_caches))
    assert not torch.equal(got_caches[0], caches[0])  # the own keys were written
    assert torch.equal(got, want)  # the C calls the composed ops make, on keys decoded as kv_quant does


# ----- the attention projections, and that the decode ops run in C -----

@pytest.mark.parametrize("index_heads", [0, 2])
def test_attention_projections_without_the_query_head_norm(kernels, index_heads):
    """V4.1's projections of one bf16 token in one C call are the bits of the default's calls on the same
    kernels (no per-head query norm: the heads only rotated)."""
    d, rank, D = 64, 48, 96
    x = make((1, D), torch.bfloat16)
    fused_x = make((rank + d + 8, D), torch.bfloat16, 1) * 0.1
    fused_qr = make((2 * d + index_heads * 32, rank), torch.bfloat16, 2) * 0.2
    g = torch.Generator().manual_seed(3)
    q_norm, kv_norm = torch.rand(rank, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    angles = make((1, 8), torch.float32, 3)
    cs = (angles.cos(), angles.sin())
    args = (x, fused_x, rank, q_norm, fused_qr, 2, kv_norm, 1e-6, *cs, index_heads,
            *(cs if index_heads else (None, None)))
    kernels.prepare_weights([("linear", fused_x), ("linear", fused_qr)])  # as the model at load
    got = CpuDeepseekV41Ops(kernels).attention_projections(*args)
    want = DeepseekV41Ops(kernels).attention_projections(*args)
    assert kernels.fused_attention_projections(*args, q_head_norm=False) is not None  # the one C call ran
    for g_, w in zip(got, want):
        assert (g_ is None and w is None) or torch.equal(g_, w)
    # V4's (per-head norm) differ: the switch reaches the C code
    assert not torch.equal(kernels.fused_attention_projections(*args)[1], got[1])


def test_decode_ops_run_in_c(kernels, monkeypatch):
    """For decode-sized bf16 and fp32 input the cpu table never falls back to the torch defaults."""
    def fallback(self, *args, **kwargs):
        raise AssertionError("fell back to the torch default")

    for name in ("hc_mix_collapse_norm", "hc_post_mix_collapse_norm", "index_select", "decode_attention_output"):
        monkeypatch.setattr(DeepseekV41Ops, name, fallback)
    ops = CpuDeepseekV41Ops(kernels)
    for dtype in DTYPES:
        streams, pre, site = site_case(2, 4, 64, dtype, torch.bfloat16)
        x, pre, post, comb = ops.hc_mix_collapse_norm(streams, pre, *site)
        ops.hc_post_mix_collapse_norm(x, streams, post, comb, pre, *site)
        q, weights, index_keys, rows, visible, positions = index_case(2, 1, 20, dtype, False)
        ops.index_select(q, weights, 0.0625, index_keys, rows, visible, 8, pool=CandidateBlocks(4, 2, 4, positions))
        for parts in (1, 2):
            q, kv, key_rows, caches, *rest = attention_case(dtype, parts)
            ops.decode_attention_output(q, kv, key_rows, tuple(c.clone() for c in caches), *rest)
