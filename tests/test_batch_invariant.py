"""Batch-invariant inference (the batch_invariant feature, DEEPINFER_BATCH_INVARIANT=1): a request's
logits (its whole log-softmax, compared bit for bit) and its greedy or seq_seed-sampled tokens are
the same alone, in a batch of 12, with max_num_seqs=3 and prompts split into prefill chunks, and
after preemption, on tiny bf16 DeepSeek-V4 and V4.1 checkpoints; the kernels behind it; the
refusals; and `deepinfer audit-determinism`, which finds 0 differences with the feature and some
without it."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.sampling_params import SamplingParams

VOCAB = 512  # the tiny checkpoints' vocabulary: logprobs=VOCAB returns each position's whole log-softmax


PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(3 + 5 * i)] for i in range(12)]


def _llm(path, invariant: bool, **kw):
    from deepinfer import LLM

    base = dict(model=path, accelerator="cpu", dtype="bfloat16", max_model_len=96, max_num_seqs=12,
                max_num_batched_tokens=256, features={"batch_invariant": {"enabled": invariant}})
    return LLM(**{**base, **kw})


def _params(temperature: float) -> list[SamplingParams]:
    # sampled requests: plain, top-k, top-p and min-p rows in one batch (the sampler's sorted path too)
    extra = [{}, {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}] if temperature else [{}]
    return [SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, logprobs=VOCAB,
                           seq_seed=None if temperature == 0 else 1000 + i, **extra[i % len(extra)])
            for i in range(12)]


def _traces(outs):
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _alone(path, params, invariant=True):
    llm = _llm(path, invariant, max_num_seqs=1)
    try:
        return [_traces(llm.generate([p], sp, use_tqdm=False))[0] for p, sp in zip(PROMPTS, params)]
    finally:
        llm.shutdown()


def _batched(path, params, invariant=True, **kw):
    llm = _llm(path, invariant, **kw)
    try:
        return _traces(llm.generate(PROMPTS, params, use_tqdm=False)), llm.stats()["num_preemptions"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.slow
def test_alone_equals_batched_bitwise(family, temperature, tiny_v4, tiny_v41, one_thread):
    path = tiny_v4 if family == "v4" else tiny_v41
    params = _params(temperature)
    alone = _alone(path, params)
    batch12, _ = _batched(path, params)
    three, _ = _batched(path, params, max_num_seqs=3, max_num_batched_tokens=16)  # prompts chunked
    for i in range(12):
        assert batch12[i] == alone[i], f"request {i} differs in a batch of 12"
        assert three[i] == alone[i], f"request {i} differs with max_num_seqs=3"


# This checkpoint's weights make request 5 meet an exact indexer-score tie (measured); with topk
# the pick depended on the padded entry count, i.e. on the batch. _select sorts stably instead.
@pytest.mark.slow
def test_v41_sampling_meets_an_indexer_tie(tmp_path, one_thread):
    from deepinfer.models.deepseek_v41.make_model import make_model

    path = str(make_model(tmp_path / "v41", "tiny", seed=0, n_routed_experts=16))  # whose weights tie
    params = _params(0.8)
    assert _batched(path, params)[0] == _alone(path, params)


@pytest.mark.slow
def test_preemption_and_chunk_sizes_keep_the_tokens(tiny_v4, one_thread):
    """Recompute after preemption and any prefill chunk size (the engine's own chunking: every
    boundary, down to one token per step) give the same bits."""
    params = _params(0.8)
    alone = _alone(tiny_v4, params)
    llm = _llm(tiny_v4, True, max_num_seqs=1)
    per_request = llm.build_info.pool.bytes_per_max_request
    llm.shutdown()
    preempted, preemptions = _batched(tiny_v4, params, max_num_seqs=4, max_num_batched_tokens=13,
                                      cache_memory_gb=2.5 * per_request / 2**30)
    assert preemptions > 0
    assert preempted == alone
    for budget in (1, 7):
        chunked, _ = _batched(tiny_v4, params, max_num_seqs=2, max_num_batched_tokens=budget)
        assert chunked == alone, f"max_num_batched_tokens={budget}"


def test_without_the_feature_batching_changes_the_logits(tiny_v4, one_thread):
    """The comparison above can fail: the default kernels pick GEMM paths by row count."""
    params = _params(0.0)
    alone = _alone(tiny_v4, params, invariant=False)
    batch12, _ = _batched(tiny_v4, params, invariant=False)
    assert sum(a != b for a, b in zip(alone, batch12)) > 0


# ----- the kernels -----

@pytest.fixture(scope="module")
def lib():
    from deepinfer_plugins.cpu import native

    library = native.active_library()
    if library is None:
        pytest.skip("no C compiler: the batch-invariant mode needs the cpu back end's C kernels")
    return library


def _check_linear_rows(lib, dtype):
    from deepinfer_plugins.cpu import native

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(70, 203, generator=g).to(dtype), torch.randn(37, 203, generator=g).to(dtype)
    full = native.linear_rows(lib, x, w)
    for m in (0, 5, 36):  # any row count, any position
        assert torch.equal(native.linear_rows(lib, x[m:m + 1], w), full[m:m + 1])
    assert torch.equal(native.linear_rows(lib, x[3:20], w), full[3:20])
    ref = x.double() @ w.double().T
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    assert ((full.double() - ref).abs() / (ref.abs() + 1)).max() < tol


def _check_attention(lib):
    from deepinfer_plugins.cpu import native

    g = torch.Generator().manual_seed(1)
    B, S, H, d, L = 2, 5, 20, 32, 41  # 20 heads: a full and a partial 16-head block
    q, kv = torch.randn(B, S, H, d, generator=g).bfloat16(), torch.randn(B, L, d, generator=g).bfloat16()
    mask, sinks = torch.rand(B, S, L, generator=g) > 0.4, torch.randn(H, generator=g)
    out = native.sink_attention_invariant(lib, q, kv, mask, sinks, 0.3)
    perm = torch.randperm(L, generator=g)
    assert torch.equal(native.sink_attention_invariant(lib, q, kv[:, perm], mask[:, :, perm], sinks, 0.3), out)
    padded = torch.cat((kv, torch.randn(B, 7, d, generator=g).bfloat16()), dim=1)
    pad_mask = torch.cat((mask, torch.zeros(B, S, 7, dtype=torch.bool)), dim=2)
    assert torch.equal(native.sink_attention_invariant(lib, q, padded, pad_mask, sinks, 0.3), out)
    assert torch.equal(native.sink_attention_invariant(lib, q[1:, 2:3], kv[1:], mask[1:, 2:3], sinks, 0.3),
                       out[1:, 2:3])
    # the same attention as the decode kernel, up to the order of the sums
    ref = native.sink_attention_decode(lib, q, kv, mask, sinks, 0.3)
    assert (out.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_is_row_count_invariant(lib, dtype):
    _check_linear_rows(lib, dtype)


def test_attention_ignores_key_order_padding_and_neighbours(lib):
    _check_attention(lib)


@pytest.mark.parametrize("experts", [8, 16, 48, 64])
def test_narrow_products_keep_torch_elementwise_math_per_row(lib, one_thread, experts):
    """A product whose width is not a multiple of 64 columns (a router's 8, 16 or 48 experts) comes back
    row-strided, so the model's own torch math on it (softplus, sigmoid) takes the same path for a row
    whatever the row count: on a contiguous tensor torch computes the last elements of its flat loop (up
    to two vectors: 31 with AVX-512) with the scalar libm function. 16 experts failed here (and a tiny
    V4.1 checkpoint's routing with them) while only widths below 16 were strided."""
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    accel = CpuAccelerator()
    accel.set_batch_invariant(True)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(513, 64, generator=g).bfloat16().float(), torch.randn(experts, 64, generator=g) * 3
    full = torch.nn.functional.softplus(accel.linear(x, w))
    rows = torch.cat([torch.nn.functional.softplus(accel.linear(x[i:i + 1], w)) for i in range(513)])
    assert torch.equal(full, rows)


def test_mhc_of_wide_streams_is_row_count_invariant(lib, one_thread):
    """Streams wider than the C hc_pre's 512-element chunks (the default sizes: 4 x 1024)."""
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    ops = CpuAccelerator()
    ops.set_batch_invariant(True)
    g = torch.Generator().manual_seed(3)
    n, D, T = 4, 1024, 7
    streams = torch.randn(T, n, D, generator=g).bfloat16()
    fn, base = torch.randn(n * (n + 2), n * D, generator=g) * 0.02, torch.randn(n * (n + 2), generator=g)
    scale = torch.rand(3, generator=g)
    full = ops.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for i in (0, 3, 6):
        one = ops.hc_pre(streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6)
        assert all(torch.equal(a[i:i + 1], b) for a, b in zip(full, one)), f"row {i}"


def test_the_mode_switches_the_kernels_and_the_op_tables_it_made(lib, one_thread):
    """The mode's ops are tables of their own (fixed_order.py), put over the kernels and over the V4.1 op
    tables made before or after it is switched on, and taken away when it is switched off: a row's result
    is then the same alone and in a batch, and the fast paths' results come back."""
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    accel = CpuAccelerator()
    before = accel.model_ops("deepseek_v41")
    g = torch.Generator().manual_seed(4)
    n, D, T = 4, 1024, 7
    streams = torch.randn(T, n, D, generator=g).bfloat16()
    fn, base = torch.randn(n * (n + 2), n * D, generator=g) * 0.02, torch.randn(n * (n + 2), generator=g)
    scale = torch.rand(3, generator=g)

    def rows_alone_equal(table) -> bool:
        full = table.hc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6)
        return all(all(torch.equal(a[i:i + 1], b) for a, b in zip(full, table.hc_mix(
            streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6))) for i in range(T))

    fast = before.hc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert not rows_alone_equal(before)  # the default's batched product: so the check below can fail
    accel.set_batch_invariant(True)
    after = accel.model_ops("deepseek_v41")
    assert rows_alone_equal(before) and rows_alone_equal(after)
    x, w = torch.randn(9, 1024, generator=g).bfloat16(), torch.randn(64, 1024, generator=g).bfloat16()
    assert torch.equal(accel.linear(x, w)[4:5], accel.linear(x[4:5], w))
    accel.set_batch_invariant(False)
    assert all(torch.equal(a, b) for a, b in zip(fast, before.hc_mix(streams, fn, base, scale, 20, 1e-6, 1e-6)))
    assert not vars(accel).keys() & {"linear", "hc_pre", "moe_experts"} and "hc_mix" not in vars(before)


@pytest.mark.slow
def test_portable_build(tmp_path, once_compiler):
    """The no-avx512 build (AVX2/FMA or older) of the same kernels keeps the guarantees."""
    from deepinfer_plugins.cpu import native

    try:
        path = tmp_path / "kernels-no-avx512.so"
        native._compile(path, once_compiler, native.build_flags("no-avx512"))
    except native.CompilerError as exc:
        pytest.skip(f"no C compiler: {exc}")
    portable = native._load(path)
    _check_linear_rows(portable, torch.bfloat16)
    _check_attention(portable)


# ----- refusals -----

def test_back_end_without_the_capability_is_refused(tiny_v4, monkeypatch):
    from deepinfer.plugins import PluginError

    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")  # the cpu back end's mode needs its C kernels
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    from deepinfer import LLM

    with pytest.raises(PluginError, match="needs the back-end capability 'batch_invariant'"):
        LLM(model=tiny_v4, accelerator="cpu", dtype="bfloat16", max_model_len=64)


def test_default_accelerator_method_refuses():
    from deepinfer.accelerator.interface import Accelerator

    class Bare:  # the interface's default, on an object without a batch-invariant mode
        name = "bare"
        set_batch_invariant = Accelerator.set_batch_invariant

    Bare().set_batch_invariant(False)
    with pytest.raises(NotImplementedError, match="Capabilities.batch_invariant is false"):
        Bare().set_batch_invariant(True)


@pytest.mark.parametrize("family, varlen, temperature", [("v4", "1", 0.0), ("v41", "1", 0.0), ("v4", "0", 0.8)])
@pytest.mark.slow
def test_speculative_decoding_keeps_the_guarantee(family, varlen, temperature, tiny_v4, tmp_path, clean_env,
                                                  one_thread):
    """The seeds' NVIDIA default with DSpark, DEEPINFER_BATCH_INVARIANT=1 with DEEPINFER_ENABLE_MTP_VARLEN=1,
    runs. How many drafts each request verifies then depends on the batch, but the forward is
    batch-invariant and greedy verification emits exactly the tokens decoding without speculation
    emits: greedy tokens and log-probabilities are the same bits alone and in batches. With
    fixed-length verification (MTP_VARLEN=0) seq_seed-sampled tokens are too (docs/batch_invariance.md).
    V4: the self drafter with 30% wrong drafts (accept and reject paths); V4.1: its DSpark head and
    confidence head."""
    from deepinfer.models.deepseek_v41.make_model import make_model

    path = tiny_v4 if family == "v4" else str(make_model(tmp_path / "v41", "tiny", seed=0, with_dspark=True))
    drafter = {"drafter": "self", "self_draft_error_rate": 0.3} if family == "v4" else {}
    clean_env.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    params = [SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, logprobs=VOCAB,
                             seq_seed=1000 + i if temperature else None) for i in range(len(PROMPTS))]

    def run(**kw):
        from deepinfer import LLM

        llm = LLM(**{**dict(model=path, accelerator="cpu", dtype="bfloat16", max_model_len=96, max_num_seqs=12,
                            max_num_batched_tokens=256, features={"dspark": drafter}), **kw})
        try:
            assert llm.engine.accelerator.invariant
            assert (llm.engine.speculator.policy is not None) == (varlen == "1")  # confidence-scheduled
            if kw.get("max_num_seqs") == 1:
                outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
            else:
                outs = llm.generate(PROMPTS, params, use_tqdm=False)
            return _traces(outs), llm.engine.spec_stats.num_drafts_verified
        finally:
            llm.shutdown()

    alone, _ = run(max_num_seqs=1)
    batch12, verified = run()
    three, _ = run(max_num_seqs=3, max_num_batched_tokens=16)  # prompts chunked
    assert verified > 0
    for i in range(len(PROMPTS)):
        assert batch12[i] == alone[i], f"request {i} differs in a batch of 12"
        assert three[i] == alone[i], f"request {i} differs with max_num_seqs=3"


def test_env_var_enables_the_feature(tiny_v4, monkeypatch):
    from deepinfer import LLM

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = LLM(model=tiny_v4, accelerator="cpu", dtype="bfloat16", max_model_len=64)
    try:
        assert "batch_invariant" in llm.engine.features.specs and llm.engine.accelerator.invariant
    finally:
        llm.shutdown()


# ----- deepinfer audit-determinism -----

@pytest.mark.slow
def test_audit_finds_no_difference_with_the_feature_and_some_without(tiny_v4, one_thread):
    from deepinfer.entrypoints.audit_determinism import AuditSettings, audit

    common = dict(model=str(tiny_v4), accelerator="cpu", max_tokens=5, batch_sizes=(12,), logprobs=VOCAB)
    on = audit(AuditSettings(**common, batch_invariant="on"))
    assert on.compared == 36 and on.differing == 0  # batch 12, reversed, preemption
    assert on.runs[-1].name == "preemption" and on.runs[-1].preemptions > 0
    off = audit(AuditSettings(**common, batch_invariant="off", preemption=False))
    assert off.differing > 0
    assert any(r.first_difference for r in off.runs) and "differ" in off.text()


def test_audit_command(tiny_v4, one_thread, capsys):
    from deepinfer.cli import main

    rc = main(["audit-determinism", "--model", str(tiny_v4), "--accelerator", "cpu", "--requests", "4",
               "--max-tokens", "3", "--batch-sizes", "2", "--no-preemption", "--batch-invariant", "on"])
    out = capsys.readouterr().out
    assert rc == 0 and "total: 8 comparisons, 0 differ" in out
    with pytest.raises(SystemExit):
        main(["audit-determinism", "--batch-sizes", "0"])
    assert "give positive integers" in capsys.readouterr().err
