"""The cpu back end's fused decode attention sub-layer (native/attention_layer.c, `attention_projections`
and `decode_attention_output`): the same bits as the composed kernels it replaces, in the kernel and in
the model, and the composed path wherever the C call does not apply; with bf16 weights, and with FP8-block
/ FP4 ones (some bf16) on the native, AVX2 (no-avx512) and portable (no-avx2) builds."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels
from model_harness import Runner, build_hf_model, build_our_model
from test_cpu_quant_experts import lib  # noqa: F401 (the per-build library fixture)
from test_cpu_quant_gemv import _fp4_weight, _fp8_weight


def fresh() -> NativeCpuKernels:
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    return kernels


def composed(kernels: NativeCpuKernels, *args):
    """V4's op table default: the calls the fused op replaces, on these kernels."""
    return DeepseekV4Ops(kernels).decode_attention_output(*args)


def fused(kernels: NativeCpuKernels, *args):
    """The cpu back end's V4 op (the fused call where it runs so)."""
    return kernels.model_ops("deepseek_v4").decode_attention_output(*args)


def count_calls(monkeypatch, name: str) -> list[int]:
    """The token counts of the C calls `native.<name>` that ran (a None from it is not counted)."""
    calls, fused = [], getattr(native, name)

    def counted(*args, **kw):
        out = fused(*args, **kw)
        if out is not None:
            calls.append(args[1].shape[0])
        return out
    monkeypatch.setattr(native, name, counted)
    return calls


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    return count_calls(monkeypatch, "attention_output")


@pytest.fixture
def projection_calls(monkeypatch) -> list[int]:
    return count_calls(monkeypatch, "attention_projections_arguments")


def expected_calls(kernels: NativeCpuKernels, dtype: torch.dtype, tokens: int, smallest: int = 1) -> list[int]:
    """The C calls of three calls on weights given to `prepare_weights` (their copies exist from the first
    call): every call for one token (the GEMVs, or the tiles) or, from `smallest` tokens, within the tiles'
    rows; none for fp32 or other sizes, nor for more than one token where AMX tiles take the products (one
    token's are the same kernels there)."""
    low, high = kernels.tuning.packed_gemm_rows
    if dtype != torch.bfloat16 or (kernels.native_amx and tokens > 1):
        return []
    return [tokens] * 3 if tokens == 1 or max(low, smallest) <= tokens <= high else []


def prepared(kernels: NativeCpuKernels, *uses: tuple[str, object]) -> NativeCpuKernels:
    """`kernels` given these weights by op, as a model gives its weights at load."""
    kernels.prepare_weights(uses)
    return kernels


def case(B: int, entries: int, dtype: torch.dtype, seed: int = 0):
    """One layer's decode inputs: 8 heads of 64 (2 output groups of rank 32 into 96 features), a window
    ring of 64 rows (own keys at distinct rows) and, with `entries`, a cache of 40 compressed entries;
    ragged key sets (the last sequence sees one window key only)."""
    g = torch.Generator().manual_seed(seed)
    H, d, G, R, D, half, Lw = 8, 64, 2, 32, 96, 8, 12

    def rnd(*shape, std=1.0):
        return (torch.randn(shape, generator=g) * std).to(dtype)
    q, kv = rnd(B, H, d), rnd(B, d)
    window = rnd(64, d)
    key_rows = torch.randperm(64, generator=g)[:B]
    rows = [torch.randint(0, 64, (B, Lw), generator=g)]
    rows[0][:, -1] = key_rows  # every query sees its own key
    masks = [torch.rand(B, 1, Lw, generator=g) > 0.3]
    masks[0][:, :, -1] = True
    masks[0][-1, :, :-1] = False
    caches = [window]
    if entries:
        caches.append(rnd(40, d))
        rows.append(torch.randint(0, 40, (B, entries), generator=g))
        masks.append(torch.rand(B, 1, entries, generator=g) > 0.5)
    angles = torch.randn(B, half, generator=g)
    sinks = torch.randn(H, generator=g)
    wo_a, wo_b = rnd(G, R, H * d // G, std=0.05), rnd(D, G * R, std=0.1)
    return q, kv, key_rows, caches, rows, masks, sinks, d ** -0.5, angles.cos(), angles.sin(), wo_a, wo_b


def run(kernels, op, inputs):
    """op on a copy of the caches -> (output, the caches after it)."""
    q, kv, key_rows, caches, rows, masks, *rest = inputs
    caches = tuple(c.clone() for c in caches)
    return op(kernels, q, kv, key_rows, caches, tuple(rows), tuple(masks), *rest), caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entries", [0, 7])  # a sliding layer; HCA / CSA (the entry rows given)
@pytest.mark.parametrize("B", [1, 3, 16, 17])
def test_fused_matches_the_composed_kernels(B, entries, dtype, fused_calls):
    inputs = case(B, entries, dtype, seed=B + entries)
    uses = ("grouped_linear", inputs[-2]), ("linear", inputs[-1])
    fused_side, composed_side = prepared(fresh(), *uses), prepared(fresh(), *uses)  # each its own copies
    for _ in range(3):  # the same path every call
        got, got_caches = run(fused_side, fused, inputs)
        want, want_caches = run(composed_side, composed, inputs)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    assert got.shape == (B, 96) and got.dtype == dtype
    # 2-15 tokens: wo_a on torch's bmm, so the composed path
    assert fused_calls == expected_calls(fused_side, dtype, B, smallest=1 if B == 1 else 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_heads", [0, 4])  # sliding / HCA layers; CSA (the indexer's query)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_fused_projections_match_the_composed_kernels(T, index_heads, dtype, projection_calls):
    g = torch.Generator().manual_seed(T + index_heads)
    D, rank, H, d, di, half = 96, 48, 4, 64, 32, 8

    def rnd(*shape, std=1.0, dt=dtype):
        return (torch.randn(shape, generator=g) * std).to(dt)
    x = rnd(T, D)
    fused_x = rnd(rank + d + 40, D, std=0.1)  # wq_a, wkv, then others (compressor inputs ...)
    fused_qr = rnd(H * d + index_heads * di, rank, std=0.2)
    q_norm, kv_norm = rnd(rank, dt=torch.float32) + 1, rnd(d, dt=torch.float32) + 1
    angles, index_angles = torch.randn(T, half, generator=g), torch.randn(T, half, generator=g)
    args = (x, fused_x, rank, q_norm, fused_qr, H, kv_norm, 1e-6, angles.cos(), angles.sin(), index_heads,
            *((index_angles.cos(), index_angles.sin()) if index_heads else (None, None)))
    uses = ("linear", fused_x), ("linear", fused_qr)
    fused_side, composed_side = prepared(fresh(), *uses), prepared(fresh(), *uses)
    for _ in range(3):
        got = fused_side.model_ops("deepseek_v4").attention_projections(*args)
        want = DeepseekV4Ops(composed_side).attention_projections(*args)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    assert got[1].shape == (T, H, d) and got[2].shape == (T, d) and got[0].shape == (T, rank + d + 40)
    assert (got[3] is None) == (index_heads == 0)
    assert projection_calls == expected_calls(fused_side, dtype, T)


def test_bad_key_rows_are_refused():
    lib = fresh().native_library
    q, kv, key_rows, caches, rows, masks, *rest = case(1, 7, torch.bfloat16)
    window = caches[0].clone()
    with pytest.raises(IndexError, match="outside the window"):  # before anything is written
        native.attention_output(lib, q, kv, key_rows + 64, tuple(caches), tuple(rows), tuple(masks), *rest,
                                None, None)
    assert torch.equal(caches[0], window)
    with pytest.raises(IndexError, match="outside its cache"):
        native.attention_output(lib, q, kv, key_rows, tuple(caches), (rows[0], rows[1] + 40), tuple(masks),
                                *rest, None, None)
    # what the C call does not take: None, nothing written (the composed path runs)
    cache_f = tuple(c.float() for c in caches)
    assert native.attention_output(lib, q, kv, key_rows, cache_f, tuple(rows), tuple(masks), *rest,
                                   None, None) is None
    q3, kv3, rows3, masks3 = q.expand(3, -1, -1).contiguous(), kv.expand(3, -1), (), ()
    assert native.attention_output(lib, q3, kv3, key_rows.expand(3), tuple(caches), rows3, masks3, *rest,
                                   None, None) is None


def test_the_model_decodes_the_same_bits(fused_calls, projection_calls, monkeypatch):
    """The tiny model (sliding, CSA and HCA layers) in bf16: ragged prefill, then decode steps of one
    and of 16 sequences, with the fused op and with the composed default; the mixed steps and the
    batches it does not take run the composed path on both. (Decode programs call by call: prepared, they
    bind these calls themselves: tests/test_cpu_prepared_program.py.)"""
    monkeypatch.setenv("DEEPINFER_CPU_DECODE_BLOCKS", "0")
    hf = build_hf_model()
    models = [build_our_model(hf, dtype=torch.bfloat16) for _ in range(2)]
    ops = models[1].ops  # the composed defaults on the second model
    ops.decode_attention_output = lambda *a, **kw: DeepseekV4Ops.decode_attention_output(ops, *a, **kw)
    ops.attention_projections = lambda *a, **kw: DeepseekV4Ops.attention_projections(ops, *a, **kw)
    runners = [Runner(m, num_slots=16) for m in models]
    lengths = [3 + 5 * i for i in range(16)]  # ragged contexts across the compression boundaries
    for r in runners:
        for i in range(16):
            r.add(i)
    outs = [r.step({0: list(range(1, 20))}) for r in runners]  # one prefill, then one sequence decodes
    for step in range(3):
        outs = [r.step({0: [int(o[0][-1].argmax())]}) for r, o in zip(runners, outs)]
        assert torch.equal(outs[0][0], outs[1][0])
    for r in runners:  # the other 15 prefill (ragged contexts): the composed path
        r.step({i: [(7 * i + j) % 500 + 1 for j in range(lengths[i])] for i in range(1, 16)})
    tokens = {i: [i + 1] for i in range(16)}
    for step in range(4):
        outs = [r.step(tokens) for r in runners]
        for i in range(16):
            assert torch.equal(outs[0][i], outs[1][i]), f"sequence {i}, decode step {step}"
        tokens = {i: [int(outs[0][i][-1].argmax())] for i in range(16)}
    kernels = models[0].blocks[0].attn.accel
    low, high = kernels.tuning.packed_gemm_rows
    if not kernels.native_amx:
        assert 1 in fused_calls and 1 in projection_calls  # one sequence's decode steps
        if max(low, 16) <= 16 <= high:
            assert 16 in fused_calls and 16 in projection_calls


# ----- the same two calls on weights kept quantised (attention_layer.py) -----

def _quant(kind: str, w: torch.Tensor, block: int = 32):
    """w (logical [*, out, in]) as `kind`: 'bf16' itself, else FP8-block / FP4 codes (test_cpu_quant_gemv's
    random codes, their scales brought near unit products), grouped like w."""
    if kind == "bf16":
        return w
    out, inp = w.shape[-2], w.shape[-1]
    rows = out * (w.shape[0] if w.dim() == 3 else 1)
    made = _fp4_weight(rows, inp, seed=rows + inp) if kind == "fp4" else \
        _fp8_weight(rows, inp, block, seed=rows + inp, fp32_scales=kind == "fp8-f32")
    scale = made.scale
    if scale.dtype is torch.float8_e8m0fnu:  # codes up to 6 / 448: products near unit size
        scale = (scale.view(torch.uint8).int() - (7 if kind == "fp4" else 12)).to(torch.uint8).view(scale.dtype)
    else:
        scale = scale / 2 ** 12
    made = QuantizedWeight(made.data, scale, made.block, made.dtype)
    return made.unflatten_rows(w.shape[0]) if w.dim() == 3 else made


def _quant_kernels(library) -> NativeCpuKernels:
    kernels = NativeCpuKernels()
    kernels.__dict__["native_library"] = library  # this build's kernels for every stage
    return kernels




QUANT_PROJECTIONS = [("fp8", "fp8"), ("fp4", "bf16"), ("bf16", "fp8-f32"), ("fp8-128", "fp4")]


@pytest.mark.parametrize("kinds", QUANT_PROJECTIONS, ids=["-".join(k) for k in QUANT_PROJECTIONS])
@pytest.mark.parametrize("index_heads", [0, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_quantised_projections_match_the_composed_kernels(lib, T, index_heads, kinds, monkeypatch):  # noqa: F811
    calls = count_calls(monkeypatch, "attention_projections_arguments")
    g = torch.Generator().manual_seed(T + index_heads)
    D, rank, H, d, di, half = 128, 64, 4, 64, 32, 8
    x = torch.randn(T, D, generator=g).bfloat16()
    shapes = ((rank + d + 40, D), (H * d + index_heads * di, rank))
    fused_x, fused_qr = (_quant(k.removesuffix("-128"), (torch.randn(s, generator=g) / s[1] ** 0.5).bfloat16(),
                                128 if k.endswith("-128") else 32) for k, s in zip(kinds, shapes))
    q_norm, kv_norm = torch.randn(rank, generator=g) + 1, torch.randn(d, generator=g) + 1
    angles, index_angles = torch.randn(T, half, generator=g), torch.randn(T, half, generator=g)
    args = (x, fused_x, rank, q_norm, fused_qr, H, kv_norm, 1e-6, angles.cos(), angles.sin(), index_heads,
            *((index_angles.cos(), index_angles.sin()) if index_heads else (None, None)))
    uses = ("linear", fused_x), ("linear", fused_qr)
    fused_side, composed_side = prepared(_quant_kernels(lib), *uses), prepared(_quant_kernels(lib), *uses)
    for _ in range(3):
        got = fused_side.model_ops("deepseek_v4").attention_projections(*args)
        want = DeepseekV4Ops(composed_side).attention_projections(*args)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    quantised = all(isinstance(w, QuantizedWeight) for w in (fused_x, fused_qr))
    assert calls == ([T] * 3 if quantised else expected_calls(fused_side, torch.bfloat16, T))


QUANT_OUTPUTS = [("fp8", "fp8"), ("bf16", "fp8"), ("fp4", "fp8-f32"), ("fp8", "bf16"), ("fp8-f32", "fp4")]


@pytest.mark.parametrize("kinds", QUANT_OUTPUTS, ids=["-".join(k) for k in QUANT_OUTPUTS])
@pytest.mark.parametrize("entries", [0, 7])
@pytest.mark.parametrize("B", [1, 3, 16])
def test_quantised_output_matches_the_composed_kernels(lib, B, entries, kinds, monkeypatch):  # noqa: F811
    calls = count_calls(monkeypatch, "attention_output")
    *inputs, wo_a, wo_b = case(B, entries, torch.bfloat16, seed=B + entries)
    wo_a, wo_b = _quant(kinds[0], wo_a), _quant(kinds[1], wo_b)
    inputs = (*inputs, wo_a, wo_b)
    uses = ("grouped_linear", wo_a), ("linear", wo_b)
    fused_side, composed_side = prepared(_quant_kernels(lib), *uses), prepared(_quant_kernels(lib), *uses)
    for _ in range(3):
        got, got_caches = run(fused_side, fused, inputs)
        want, want_caches = run(composed_side, composed, inputs)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    assert got.shape == (B, 96) and got.dtype == torch.bfloat16
    quantised_a, quantised_b = isinstance(wo_a, QuantizedWeight), isinstance(wo_b, QuantizedWeight)
    if quantised_a and quantised_b:
        expected = [B] * 3
    elif quantised_a:  # wo_b's product as for bf16 weights
        expected = expected_calls(fused_side, torch.bfloat16, B)
    else:  # a bf16 wo_a: one token's grouped GEMV; 2-15 tokens on torch's bmm (the composed path)
        expected = [1] * 3 if B == 1 else expected_calls(fused_side, torch.bfloat16, B, smallest=16)
    assert calls == expected


def test_quantised_bad_key_rows_are_refused():
    lib = fresh().native_library
    *inputs, wo_a, wo_b = case(1, 7, torch.bfloat16)
    q, kv, key_rows, caches, rows, masks, *rest = (*inputs, _quant("fp8", wo_a), _quant("fp8", wo_b))
    window = caches[0].clone()
    with pytest.raises(IndexError, match="outside the window"):
        native.attention_output(lib, q, kv, key_rows + 64, tuple(caches), tuple(rows), tuple(masks), *rest,
                                None, None)
    assert torch.equal(caches[0], window)
    with pytest.raises(IndexError, match="outside its cache"):
        native.attention_output(lib, q, kv, key_rows, tuple(caches), (rows[0], rows[1] + 40), tuple(masks),
                                *rest, None, None)
    # what the C call does not take: None, nothing written (the composed path runs)
    cache_f = tuple(c.float() for c in caches)
    assert native.attention_output(lib, q, kv, key_rows, cache_f, tuple(rows), tuple(masks), *rest,
                                   None, None) is None
    assert native.attention_output(lib, q, kv, key_rows, tuple(caches), tuple(rows), tuple(masks), *rest[:-1],
                                   rest[-1].dequantize(torch.float32), None, None) is None
