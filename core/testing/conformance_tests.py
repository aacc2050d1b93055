"""The conformance tests (run through `deepinfer.testing.conformance`; see that module).

Fixtures: `acc` (the back end under test, instantiated), `ref` (the float64 reference kernels,
`deepinfer.testing.conformance.ReferenceAccelerator`, independent of every back end),
`accelerator_class`, `accelerator_name`, `model_family` (the family under test: --checkpoint's,
else DeepSeek-V4). Tests marked `family("deepseek_v4")` check DeepSeek-V4's own op table and are
skipped for another family.
"""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.accelerator import interface as api
from deepinfer.models.deepseek_v4.ops import FAMILY as DEEPSEEK_V4, resolve_ops
from deepinfer.models.registry import checkpoint_family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _dtypes(acc):
    return [DTYPES[d] for d in acc.capabilities().dtypes if d in DTYPES]


def _close(got, want, dtype, what):
    got = got.detach().to("cpu", torch.float32)
    want = want.detach().to("cpu", torch.float32)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{what} ({dtype}): {m}")


def _on(acc, *tensors):
    dev = acc.device()
    return [t.to(dev) if isinstance(t, torch.Tensor) else t for t in tensors]


# ------------------------------------------------------------------------------------ level 0


@pytest.mark.level(0)
def test_is_an_accelerator_with_compatible_interface(accelerator_class):
    assert issubclass(accelerator_class, api.Accelerator)
    assert api.interface_compatible(accelerator_class.interface_version), \
        f"interface {accelerator_class.interface_version} vs core {api.INTERFACE_VERSION}"
    assert not inspect.isabstract(accelerator_class), \
        f"abstract methods left: {sorted(accelerator_class.__abstractmethods__)}"


@pytest.mark.level(0)
def test_entry_point_name_matches(accelerator_class, accelerator_name):
    assert accelerator_class.name == accelerator_name


@pytest.mark.level(0)
def test_signatures_match_the_interface(accelerator_class):
    for base in (api.DeviceMemory, api.SmallOps, api.AttentionOps, api.MoEOps, api.SamplingOps, api.Collectives):
        api._check_signatures(accelerator_class, base)


@pytest.mark.level(0)
def test_model_ops_are_declared_as_op_tables(acc, model_family):
    """`model_ops(family)` is None (the model's defaults) or an instance of the family's op table
    (`OpDefaults.model_ops`); always None for a family without one."""
    table = acc.model_ops(model_family.model_type)
    op_table = model_family.op_defaults.model_ops
    assert table is None or (op_table is not None and isinstance(table, op_table)), \
        f"model_ops({model_family.model_type!r}) returned a {type(table).__name__}, not None or a " \
        f"{getattr(op_table, '__name__', 'None')}"
    assert acc.model_ops("no_such_family") is None


@pytest.mark.level(0)
def test_capabilities_are_frozen_and_consistent(acc, accelerator_class):
    caps = acc.capabilities()
    assert isinstance(caps, api.Capabilities) and caps.name == accelerator_class.name
    with pytest.raises(Exception):
        caps.name = "other"  # frozen
    assert set(caps.dtypes) <= set(DTYPES)


IMPORT_SAFETY = r"""
import json, os, sys
before = dict(os.environ)
from deepinfer.plugins import load_accelerator_class
cls = load_accelerator_class(sys.argv[1])
result = cls.probe()
import torch
print(json.dumps({
    "probe_type": type(result).__name__,
    "env_changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
    "cuda_initialized": bool(torch.cuda.is_initialized()),
    "npu_imported": "torch_npu" in sys.modules and sys.argv[1] != "ascend",
}))
"""


@pytest.mark.level(0)
def test_import_and_probe_are_safe(accelerator_name):
    """Importing the plugin and probing must not raise, initialise a device runtime, or change env."""
    out = subprocess.run([sys.executable, "-c", IMPORT_SAFETY, accelerator_name], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["probe_type"] == "ProbeResult"
    assert facts["env_changed"] == [], f"probe changed the environment: {facts['env_changed']}"
    assert not facts["cuda_initialized"], "import + probe initialised CUDA"


# ------------------------------------------------------------------------------------ level 1


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.level(1)
def test_linear(acc, ref):
    g = _gen(1)
    for dtype in _dtypes(acc):
        x, w = torch.randn(7, 48, generator=g).to(dtype), torch.randn(24, 48, generator=g).to(dtype)
        _close(acc.linear(*_on(acc, x, w)), ref.linear(x, w), dtype, "linear")


@pytest.mark.level(1)
def test_grouped_linear(acc, ref):
    g = _gen(11)
    for dtype in _dtypes(acc):
        for rows in (1, 20):  # decode-sized and prefill-sized paths
            x, w = torch.randn(rows, 3, 32, generator=g).to(dtype), torch.randn(3, 16, 32, generator=g).to(dtype)
            want = torch.stack([ref.linear(x[:, i], w[i]) for i in range(3)], dim=1)
            _close(acc.grouped_linear(*_on(acc, x, w)), want, dtype, "grouped_linear")


@pytest.mark.level(1)
def test_rms_norm(acc, ref):
    g = _gen(2)
    for dtype in _dtypes(acc):
        x = torch.randn(5, 3, 32, generator=g).to(dtype)
        w = torch.rand(32, generator=g) + 0.5
        _close(acc.rms_norm(*_on(acc, x, w), 1e-6), ref.rms_norm(x, w, 1e-6), dtype, "rms_norm")
        _close(acc.rms_norm(*_on(acc, x), None, 1e-6), ref.rms_norm(x, None, 1e-6), dtype, "rms_norm(unweighted)")


@pytest.mark.level(1)
def test_rotary(acc, ref):
    g = _gen(3)
    for dtype in _dtypes(acc):
        x = torch.randn(6, 4, 32, generator=g).to(dtype)
        ang = torch.rand(6, 4, generator=g) * 6.0
        cos, sin = ang.cos(), ang.sin()
        for inverse in (False, True):
            _close(acc.rotary(*_on(acc, x, cos, sin), inverse), ref.rotary(x, cos, sin, inverse), dtype, "rotary")


@pytest.mark.level(1)
def test_rms_norm_rotary(acc, ref):
    g = _gen(11)
    for dtype in _dtypes(acc):
        x = torch.randn(6, 4, 32, generator=g).to(dtype)
        ang = torch.rand(6, 4, generator=g) * 6.0
        w = torch.rand(32, generator=g) + 0.5
        for weight in (w, None):
            _close(acc.rms_norm_rotary(*_on(acc, x, weight, 1e-6, ang.cos(), ang.sin())),
                   ref.rms_norm_rotary(x, weight, 1e-6, ang.cos(), ang.sin()), dtype, "rms_norm_rotary")


@pytest.mark.level(1)
def test_swiglu(acc, ref):
    g = _gen(4)
    for dtype in _dtypes(acc):
        a, b = (torch.randn(9, 16, generator=g) * 8).to(dtype), (torch.randn(9, 16, generator=g) * 8).to(dtype)
        _close(acc.swiglu(*_on(acc, a, b), 10.0), ref.swiglu(a, b, 10.0), dtype, "swiglu")


def _hc_params(g, n=4, d=16):
    return (torch.randn((2 + n) * n, n * d, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g) * 0.1,
            torch.rand(3, generator=g) + 0.5)


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_hc_pre_post_head(acc, ref):
    """DeepSeek-V4's mHC ops, as the model resolves them on the back end (its model_ops or the defaults);
    hc_post_pre_norm against the reference's hc_post then hc_pre_norm."""
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(5)
    for dtype in _dtypes(acc):
        streams = torch.randn(5, 4, 16, generator=g).to(dtype)
        fn, base, scale = _hc_params(g)
        got = acc_ops.hc_pre(*_on(acc, streams, fn, base, scale), 20, 1e-6, 1e-6)
        want = ref_ops.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        for name, a, b in zip(("collapsed", "post", "comb"), got, want):
            _close(a, b, dtype, f"hc_pre.{name}")
        y = torch.randn(5, 16, generator=g).to(dtype)
        _close(acc_ops.hc_post(*_on(acc, y, streams, want[1], want[2])), ref_ops.hc_post(y, streams, want[1], want[2]),
               dtype, "hc_post")
        norm = torch.rand(16, generator=g) + 0.5
        got = acc_ops.hc_pre_norm(*_on(acc, streams, fn, base, scale), 20, 1e-6, 1e-6, *_on(acc, norm), 1e-6)
        want_norm = ref_ops.hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6)
        for name, a, b in zip(("normed", "post", "comb"), got, want_norm):
            _close(a, b, dtype, f"hc_pre_norm.{name}")
        got = acc_ops.hc_post_pre_norm(*_on(acc, y, streams, want[1], want[2], fn, base, scale), 20, 1e-6, 1e-6,
                                       *_on(acc, norm), 1e-6)
        mixed = ref_ops.hc_post(y, streams, want[1], want[2])
        want_next = (mixed, *ref_ops.hc_pre_norm(mixed, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6))
        for name, a, b in zip(("streams", "normed", "post", "comb"), got, want_next):
            _close(a, b, dtype, f"hc_post_pre_norm.{name}")
        hfn, hbase, hscale = torch.randn(4, 64, generator=g) * 0.1, torch.randn(4, generator=g), torch.rand(1, generator=g)
        _close(acc_ops.hc_head(*_on(acc, streams, hfn, hbase, hscale), 1e-6, 1e-6),
               ref_ops.hc_head(streams, hfn, hbase, hscale, 1e-6, 1e-6), dtype, "hc_head")


@pytest.mark.level(1)
def test_sink_attention_ragged_masks(acc, ref):
    g = _gen(6)
    for dtype in _dtypes(acc):
        q = torch.randn(3, 5, 4, 32, generator=g).to(dtype)
        kv = torch.randn(3, 11, 32, generator=g).to(dtype)
        mask = torch.rand(3, 5, 11, generator=g) > 0.4
        mask[1] = False  # a sequence with nothing visible: output must be 0, not NaN
        mask[2, :, 7:] = False  # ragged: shorter key set
        sinks = torch.randn(4, generator=g)
        got = acc.sink_attention(*_on(acc, q, kv, mask, sinks), 32 ** -0.5)
        want = ref.sink_attention(q, kv, mask, sinks, 32 ** -0.5)
        assert torch.isfinite(got.float()).all()
        _close(got, want, dtype, "sink_attention")


@pytest.mark.level(1)
def test_sink_attention_rows(acc, ref):
    g = _gen(16)
    for dtype in _dtypes(acc):
        q = torch.randn(3, 1, 4, 32, generator=g).to(dtype)
        window, entries = torch.randn(12, 32, generator=g).to(dtype), torch.randn(9, 32, generator=g).to(dtype)
        rows = (torch.randint(0, 12, (3, 6), generator=g), torch.randint(0, 9, (3, 4), generator=g))
        masks = (torch.rand(3, 1, 6, generator=g) > 0.3, torch.rand(3, 1, 4, generator=g) > 0.3)
        masks[0][1] = False  # a sequence that sees only compressed entries
        sinks = torch.randn(4, generator=g)
        for parts in (1, 2):
            caches = (window, entries)[:parts]
            got = acc.sink_attention_rows(*_on(acc, q), tuple(_on(acc, *caches)), tuple(_on(acc, *rows[:parts])),
                                          tuple(_on(acc, *masks[:parts])), *_on(acc, sinks), 32 ** -0.5)
            want = ref.sink_attention_rows(q, caches, rows[:parts], masks[:parts], sinks, 32 ** -0.5)
            _close(got, want, dtype, f"sink_attention_rows ({parts} parts)")


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_attention_projections(acc, ref):
    """V4's attention input projections, norms and rotaries (with and without the indexer's query),
    three times on the same weights (a back end may switch kernels once it has seen them)."""
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(17)
    D, rank, H, d, Hi, di, half, T = 48, 24, 2, 32, 2, 16, 4, 2
    for dtype in _dtypes(acc):
        fused_x = (torch.randn(rank + d + 8, D, generator=g) * 0.2).to(dtype)
        fused_qr = (torch.randn(H * d + Hi * di, rank, generator=g) * 0.3).to(dtype)
        q_norm, kv_norm = torch.rand(rank, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
        angles = torch.randn(T, half, generator=g)
        for index_heads in (0, Hi):
            qr = fused_qr if index_heads else fused_qr[:H * d].contiguous()
            for tokens in (1, T):
                x = torch.randn(tokens, D, generator=g).to(dtype)
                cs = (angles[:tokens].cos(), angles[:tokens].sin())
                index = cs if index_heads else (None, None)
                want = ref_ops.attention_projections(x, fused_x, rank, q_norm, qr, H, kv_norm, 1e-6, *cs, index_heads,
                                                 *index)
                for _ in range(3):
                    got = acc_ops.attention_projections(*_on(acc, x, fused_x), rank, *_on(acc, q_norm, qr), H,
                                                    *_on(acc, kv_norm), 1e-6, *_on(acc, *cs), index_heads,
                                                    *(_on(acc, *index) if index_heads else index))
                    for name, a, b in zip(("px", "q", "kv", "index_q"), got, want):
                        assert (a is None) == (b is None), name
                        if b is not None:
                            _close(a, b, dtype, f"attention_projections {name} ({tokens} tokens)")


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_decode_attention_output(acc, ref):
    """V4's decode attention from the own keys' write to the output projection, one and two key parts,
    three times on the same weights."""
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(18)
    B, H, d, G, R, D, half = 3, 4, 32, 2, 16, 24, 4
    for dtype in _dtypes(acc):
        wo_a = (torch.randn(G, R, H * d // G, generator=g) * 0.2).to(dtype)
        wo_b = (torch.randn(D, G * R, generator=g) * 0.2).to(dtype)
        sinks = torch.randn(H, generator=g)
        angles = torch.randn(B, half, generator=g)
        for tokens in (1, B):
            q = torch.randn(tokens, H, d, generator=g).to(dtype)
            kv = torch.randn(tokens, d, generator=g).to(dtype)
            window, entries = torch.randn(12, d, generator=g).to(dtype), torch.randn(9, d, generator=g).to(dtype)
            key_rows = torch.randperm(12, generator=g)[:tokens]
            rows = (torch.cat((torch.randint(0, 12, (tokens, 5), generator=g), key_rows[:, None]), dim=1),
                    torch.randint(0, 9, (tokens, 4), generator=g))
            masks = (torch.rand(tokens, 1, 6, generator=g) > 0.3, torch.rand(tokens, 1, 4, generator=g) > 0.3)
            cs = (angles[:tokens].cos(), angles[:tokens].sin())
            for parts in (1, 2):
                ref_caches = (window.clone(), entries)[:parts]
                want = ref_ops.decode_attention_output(q, kv, key_rows, ref_caches, rows[:parts], masks[:parts], sinks,
                                                   d ** -0.5, *cs, wo_a, wo_b)
                for _ in range(3):
                    caches = tuple(_on(acc, window.clone(), entries))[:parts]
                    got = acc_ops.decode_attention_output(*_on(acc, q, kv, key_rows), caches,
                                                      tuple(_on(acc, *rows[:parts])), tuple(_on(acc, *masks[:parts])),
                                                      *_on(acc, sinks), d ** -0.5, *_on(acc, *cs, wo_a, wo_b))
                    _close(got, want, dtype, f"decode_attention_output ({tokens} tokens, {parts} parts)")
                    assert torch.equal(caches[0].cpu(), ref_caches[0]), "the own keys' rows of the window"


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_compress_pool(acc, ref):
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(7)
    for dtype in _dtypes(acc):
        kv = torch.randn(2, 3, 8, 16, generator=g)
        score = torch.randn(2, 3, 8, 16, generator=g)
        score[0, 0, :4] = float("-inf")  # empty overlap slots of the first CSA window
        _close(acc_ops.compress_pool(*_on(acc, kv, score)), ref_ops.compress_pool(kv, score), torch.float32,
               "compress_pool")


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_indexer_topk(acc, ref):
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(8)
    q = torch.randn(2, 5, 16, 8, generator=g)
    w = torch.randn(2, 5, 16, generator=g)
    keys = torch.randn(2, 12, 8, generator=g)
    mask = torch.ones(2, 5, 12, dtype=torch.bool)
    mask[1, :, 6:] = False
    mask[0, 0, 2:] = False  # fewer visible than k: extra picks must be -1
    got = acc_ops.indexer_topk(*_on(acc, q, w, keys, mask), 4).cpu()
    want = ref_ops.indexer_topk(q, w, keys, mask, 4)
    assert got.shape == want.shape
    for a, b in zip(got.reshape(-1, 4).tolist(), want.reshape(-1, 4).tolist()):
        assert sorted(a) == sorted(b), "indexer_topk selected a different set"


@pytest.mark.level(1)
def test_moe_pipeline(acc, ref):
    g = _gen(9)
    T, E, K, D, inter = 13, 8, 2, 16, 12
    for dtype in _dtypes(acc):
        scores = torch.nn.functional.softplus(torch.randn(T, E, generator=g)).sqrt()
        bias = torch.randn(E, generator=g) * 0.1
        x = torch.randn(T, D, generator=g).to(dtype)
        w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.3).to(dtype)
        w2 = (torch.randn(E, D, inter, generator=g) * 0.3).to(dtype)
        for hash_ids in (None, torch.randint(0, E, (T, K), generator=g)):
            wa, ia = acc.moe_route(*_on(acc, scores, bias), K, 1.5, None if hash_ids is None else hash_ids.to(acc.device()))
            wr, ir = ref.moe_route(scores, bias, K, 1.5, hash_ids)
            assert ia.cpu().sort(-1).values.tolist() == ir.sort(-1).values.tolist(), "moe_route picked other experts"
            _close(wa.sort(-1).values, wr.sort(-1).values, torch.float32, "moe_route weights")
            rows_a, plan_a = acc.moe_dispatch(*_on(acc, x, ia), E)
            out_a = acc.moe_combine(acc.moe_experts(rows_a, plan_a, *_on(acc, w13, w2), 10.0), plan_a, wa)
            rows_r, plan_r = ref.moe_dispatch(x, ir, E)
            out_r = ref.moe_combine(ref.moe_experts(rows_r, plan_r, w13, w2, 10.0), plan_r, wr)
            _close(out_a, out_r, dtype, "moe dispatch->experts->combine")


@pytest.mark.level(1)
def test_moe_sublayer(acc, ref):
    """The whole MoE layer (router, routing, experts, combine, shared expert) at decode and prefill sizes."""
    g = _gen(12)
    E, K, D, inter = 8, 2, 16, 12
    for dtype in _dtypes(acc):
        gate = torch.randn(E, D, generator=g) * 0.5
        bias = torch.randn(E, generator=g) * 0.1
        w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.3).to(dtype)
        w2 = (torch.randn(E, D, inter, generator=g) * 0.3).to(dtype)
        sw13 = (torch.randn(2 * inter, D, generator=g) * 0.3).to(dtype)
        sw2 = (torch.randn(D, inter, generator=g) * 0.3).to(dtype)
        for T in (1, 3, 13):
            x = torch.randn(T, D, generator=g).to(dtype)
            for hash_ids, shared in ((None, (sw13, sw2)), (torch.randint(0, E, (T, K), generator=g), (None, None))):
                got = acc.moe_sublayer(*_on(acc, x, gate, bias, hash_ids, w13, w2, *shared), K, 1.5, "sqrtsoftplus",
                                       10.0)
                want = ref.moe_sublayer(x, gate, bias, hash_ids, w13, w2, *shared, K, 1.5, "sqrtsoftplus", 10.0)
                _close(got, want, dtype, f"moe_sublayer ({T} tokens)")


@pytest.mark.level(1)
@pytest.mark.family(DEEPSEEK_V4)
def test_compress_store(acc, ref):
    acc_ops, ref_ops = resolve_ops(acc), resolve_ops(ref)
    g = _gen(13)
    for dtype in _dtypes(acc):
        kv, score = torch.randn(3, 24, generator=g).to(dtype), torch.randn(3, 24, generator=g).to(dtype)
        ape = torch.randn(4, 24, generator=g)
        position_mod, ring_row = torch.tensor([1, 3, 0]), torch.tensor([7, 2, 4])
        got = [torch.zeros(8, 24, device=acc.device()) for _ in range(2)]
        want = [torch.zeros(8, 24) for _ in range(2)]
        acc_ops.compress_store(*_on(acc, kv, score, ape, position_mod, ring_row), *got)
        ref_ops.compress_store(kv, score, ape, position_mod, ring_row, *want)
        _close(got[0], want[0], torch.float32, "compress_store.kv")
        _close(got[1], want[1], torch.float32, "compress_store.score")


# ------------------------------------------------------------------------------------ level 2


@pytest.mark.level(2)
def test_greedy_is_exact(acc):
    probs = torch.zeros(4, 50)
    probs[torch.arange(4), torch.tensor([3, 0, 49, 17])] = 1.0
    got = acc.sample(*_on(acc, probs), [None] * 4).cpu()
    assert got.tolist() == [3, 0, 49, 17]


@pytest.mark.level(2)
def test_samples_stay_in_support(acc):
    g = _gen(10)
    probs = torch.zeros(64, 100)
    support = torch.randint(0, 100, (64, 5), generator=g)
    probs.scatter_(1, support, torch.rand(64, 5, generator=g) + 0.1)
    probs /= probs.sum(-1, keepdim=True)
    got = acc.sample(*_on(acc, probs), [None] * 64).cpu()
    assert all(t in s for t, s in zip(got.tolist(), support.tolist()))


@pytest.mark.level(1)
def test_argmax_logsumexp(acc):
    logits = torch.randn(5, 3000, generator=_gen(14)) * 5
    logits[0, 7] = logits[0, 2000] = 80.0  # a tie: the first index, as argmax
    logits[1, :2990] = float("-inf")  # mostly masked
    index, log_norm = acc.argmax_logsumexp(*_on(acc, logits))
    assert index.cpu().tolist() == logits.argmax(-1).tolist(), "argmax_logsumexp: not the first maximal index"
    _close(log_norm, torch.logsumexp(logits, -1), torch.float32, "argmax_logsumexp")


@pytest.mark.level(1)
def test_argmax_logsumexp_flags_non_finite_rows(acc):
    """The engine fails a request whose logits are broken by this normaliser (docs/engine.md): it
    must not be finite for a row with a NaN or a +inf, or with every logit -inf, and must be finite
    for a row where only some logits are -inf."""
    logits = torch.randn(4, 300, generator=_gen(15))
    logits[0, 5] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, :200] = float("-inf")
    _, log_norm = acc.argmax_logsumexp(*_on(acc, logits))
    assert torch.isfinite(log_norm.cpu()).tolist() == [False, False, False, True], \
        "argmax_logsumexp: the log-sum-exp of a NaN, +inf or all -inf row must not be finite"


@pytest.mark.level(2)
def test_seeded_sampling_is_deterministic_per_row(acc):
    probs = torch.softmax(torch.randn(3, 1000, generator=_gen(11)), -1)
    dev = acc.device()

    def draw(seeds):
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        return acc.sample(probs.to(dev), gens).cpu().tolist()

    a, b = draw([1, 2, 3]), draw([1, 2, 3])
    assert a == b
    # a row's draw depends only on its own generator, not on the other rows
    assert draw([1, 99, 98])[0] == a[0]


@pytest.mark.level(2)
@pytest.mark.capability("token_bitmask")
def test_token_bitmask_including_all_masked_row(acc, ref):
    V = 100
    words = (V + 31) // 32
    allowed = [[5, 6, 99], [0], [], list(range(V))]
    bitmask = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, toks in enumerate(allowed):
        for t in toks:
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    logits = torch.randn(len(allowed), V, generator=_gen(12))
    got = logits.clone().to(acc.device())
    acc.apply_token_bitmask(got, bitmask.to(acc.device()))
    got = got.cpu()
    for r, toks in enumerate(allowed):
        finite = torch.isfinite(got[r]).nonzero().flatten().tolist()
        assert finite == sorted(toks), f"row {r}: allowed {finite}, expected {sorted(toks)}"
        assert not torch.isnan(got[r]).any()
    torch.testing.assert_close(got[0, [5, 6, 99]], logits[0, [5, 6, 99]])


@pytest.mark.level(2)
@pytest.mark.capability("rejection_sampling")
def test_rejection_sampling_exact_cases_support_and_seeds(acc):
    dev = acc.device()
    # a one-hot target accepts a draft exactly when it is the target's token, then stops or adds a bonus
    target = torch.zeros(7, 8)
    target[torch.arange(7), torch.tensor([3, 1, 4, 1, 5, 2, 6])] = 1.0
    drafts = torch.tensor([3, 1, 5, 5, 2])  # request 0: 3 drafts, the third wrong; request 1: 2 right ones
    got = acc.rejection_sample(target.to(dev), None, drafts.to(dev), [3, 2], [None, None]).cpu().tolist()
    assert got == [[3, 1, 4, -1], [5, 2, 6, -1]], "one-hot target must act as exact match, with a bonus token"
    # sampled drafts: every emitted token lies in the target's support; seeded requests repeat
    g = _gen(13)
    p = torch.rand(7, 50, generator=g) * (torch.rand(7, 50, generator=g) > 0.5)
    p /= p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(5, 50, generator=g), -1)
    d = torch.multinomial(q, 1, generator=g).squeeze(1)

    def run(seeds):
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        return acc.rejection_sample(*_on(acc, p, q, d), [3, 2], gens).cpu()

    a = run([1, 2])
    rows = [p[0:4], p[4:7]]
    for r, out in enumerate(a.tolist()):
        emitted = [t for t in out if t >= 0]
        assert emitted and all(rows[r][i, t] > 0 for i, t in enumerate(emitted)), f"request {r} left the support"
    assert torch.equal(run([1, 2]), a) and torch.equal(run([1, 77])[0], a[0])


# ------------------------------------------------------------------------------------ level 3


@pytest.mark.level(3)
def test_memory_info_is_consistent(acc):
    info = acc.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    drops = []
    # Other processes move the figure on a shared host, and a virtual machine's RAM accounting can
    # lag or return pages (seen: 1 GiB touched lowered MemAvailable by only 290-550 MiB): the best
    # of 3 tries must show at least an eighth of the block.
    for _ in range(3):
        before = acc.memory_info().free_bytes
        block = torch.rand(2**30 // 4, device=acc.device())  # 1 GiB, touched, not deduplicable
        acc.synchronize()
        drops.append(before - acc.memory_info().free_bytes)
        del block
        if drops[-1] > 128 * 2**20:
            break
    assert max(drops) > 128 * 2**20, f"allocating 1 GiB lowered free memory by at most {max(drops) / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------ level 4


def _collective_worker(rank, world, name, init, queue):
    from deepinfer.plugins import load_accelerator_class
    acc = load_accelerator_class(name)()
    torch.set_num_threads(1)
    acc.init_process_group(rank, world, init)
    dev = acc.device(rank if acc.capabilities().device_type != "cpu" else 0)
    t = torch.full((3,), float(rank + 1), device=dev)
    reduced = acc.all_reduce(t.clone()).cpu().tolist()
    gathered = acc.all_gather(torch.tensor([rank, rank], device=dev)).cpu().tolist()
    # uneven all-to-all: rank r sends (r + j + 1) rows to rank j
    send = [rank + j + 1 for j in range(world)]
    recv = [j + rank + 1 for j in range(world)]
    x = torch.cat([torch.full((n, 2), float(rank * 10 + j), device=dev) for j, n in enumerate(send)])
    y = acc.all_to_all(x, send, recv).cpu()
    # EP dispatch -> combine identity: send rows out and back
    back = acc.all_to_all(y.to(dev), recv, send).cpu()
    queue.put((rank, reduced, gathered, y[:, 0].tolist(), bool(torch.equal(back, x.cpu()))))
    torch.distributed.destroy_process_group()


def _run_two_ranks(acc, accelerator_name: str, tmp_path, worker, world: int = 2) -> list:
    """`worker(rank, world, name, init, queue)` in `world` spawned processes; what each put on the
    queue. Skips when the back end declares no collectives or has fewer than `world` devices."""
    caps = acc.capabilities()
    if caps.collectives == "none":
        pytest.skip("no collectives declared")
    devices = getattr(getattr(torch, caps.device_type, None), "device_count", lambda: 0)
    if caps.device_type != "cpu" and devices() < world:
        pytest.skip(f"needs {world} devices")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=worker, args=(r, world, accelerator_name, init, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.level(4)
def test_collectives_two_ranks(acc, accelerator_name, tmp_path):
    results = sorted(_run_two_ranks(acc, accelerator_name, tmp_path, _collective_worker))
    for rank, reduced, gathered, received, identity in results:
        assert reduced == [3.0, 3.0, 3.0]
        assert gathered == [0, 0, 1, 1]
        expected = [float(src * 10 + rank) for src in range(2) for _ in range(src + rank + 1)]
        assert received == expected, "uneven all_to_all delivered the wrong rows"
        assert identity, "dispatch -> combine did not return the original rows"


def _expert_parallel_moe(acc, ep, dev):
    """Register a MoE of fixed random experts with `ep` (the same full weights on every rank; each
    rank keeps its own experts) and return `moe_error(T, seed)`: one EP-exchanged call of T random
    tokens, its max |difference| from running every expert locally."""
    E, D, I, k = 8, 16, 8, 2
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dev)
    w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dev)
    mine13, mine2 = ep.local_experts(w13), ep.local_experts(w2)
    key = ep.register(lambda rows, plan: acc.moe_experts(rows, plan, mine13, mine2, 10.0), D, E)

    def moe_error(T, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(T, D, generator=gen).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
        weights = torch.rand(T, k, generator=gen).to(dev)
        rows, plan = acc.moe_dispatch(x, ids, E)
        got = acc.moe_combine(ep.experts(key, rows, plan), plan, weights)
        want = acc.moe_combine(acc.moe_experts(rows, plan, w13, w2, 10.0), plan, weights)
        return float((got - want).abs().max())

    return moe_error


def _expert_parallel_worker(rank, world, name, init, queue):
    """Two EP ranks with uneven token counts, then rank 1 idle while rank 0 makes one more MoE
    call; every result is compared with all experts run locally."""
    from deepinfer.parallel.expert_parallel import ExpertParallel
    from deepinfer.plugins import load_accelerator_class
    acc = load_accelerator_class(name)()
    torch.set_num_threads(1)
    acc.init_process_group(rank, world, init)
    dev = acc.device(rank if acc.capabilities().device_type != "cpu" else 0)
    ep = ExpertParallel(acc, rank, world, dev)
    moe_error = _expert_parallel_moe(acc, ep, dev)
    errors = [moe_error(5 + 2 * rank, 10 + rank)]  # uneven counts in both directions
    if rank == 0:
        errors.append(moe_error(4, 99))  # rank 1 has no work: it must still serve its experts
    ep.idle_until_peers_done()
    queue.put((rank, errors))
    torch.distributed.destroy_process_group()


@pytest.mark.level(4)
def test_collectives_expert_parallel_dispatch_combine_two_ranks(acc, accelerator_name, tmp_path):
    """deepinfer.parallel's EP exchange on this back end's collectives and MoE kernels equals
    running every expert locally, including a call an idle rank serves."""
    results = dict(_run_two_ranks(acc, accelerator_name, tmp_path, _expert_parallel_worker))
    assert len(results[0]) == 2 and len(results[1]) == 1
    for rank, errors in results.items():
        assert max(errors) < 1e-4, f"rank {rank}: expert-parallel MoE differs from local experts by {errors}"


def _sub_group_worker(rank, world, name, init, queue):
    """Four ranks: collectives on the pairs [0, 1] / [2, 3] and on [0, 2] / [1, 3], then
    deepinfer.parallel's EP exchange in two EP groups of 2 while the second group has no work."""
    from deepinfer.parallel.expert_parallel import ExpertParallel
    from deepinfer.parallel.groups import make_groups
    from deepinfer.parallel.layout import ParallelLayout
    from deepinfer.plugins import load_accelerator_class
    acc = load_accelerator_class(name)()
    torch.set_num_threads(1)
    acc.init_process_group(rank, world, init)
    dev = acc.device(rank if acc.capabilities().device_type != "cpu" else 0)
    pairs = [acc.new_group([0, 1]), acc.new_group([2, 3])]  # every rank makes every group, in one order
    strided = [acc.new_group([0, 2]), acc.new_group([1, 3])]
    pair, me = pairs[rank // 2], rank % 2
    out = {"reduced": acc.all_reduce(torch.full((2,), float(rank + 1), device=dev), group=pair).cpu().tolist(),
           "gathered": acc.all_gather(torch.tensor([rank], device=dev), group=pair).cpu().tolist(),
           "strided": acc.all_gather(torch.tensor([rank], device=dev), group=strided[rank % 2]).cpu().tolist()}
    send = [me + j + 1 for j in range(2)]  # uneven: group rank g sends g + j + 1 rows to member j
    x = torch.cat([torch.full((n, 2), float(rank * 10 + j), device=dev) for j, n in enumerate(send)])
    y = acc.all_to_all(x, send, [j + me + 1 for j in range(2)], group=pair)
    out["received"] = y[:, 0].cpu().tolist()
    out["world"] = acc.all_reduce(torch.ones(1, device=dev)).cpu().tolist()  # the world still works
    # EP over sub-groups: the layout's EP groups [0, 1] and [2, 3]; group 1 is idle throughout
    groups = make_groups(acc, ParallelLayout(ep=2, dp=4), rank)
    ep = ExpertParallel(groups.ep, groups.ep.rank, groups.ep.size, dev)
    moe_error = _expert_parallel_moe(acc, ep, dev)
    errors = [moe_error(T, T + rank) for T in ([3 + 2 * me, 4] if rank < 2 else [])]
    ep.idle_until_peers_done()
    out.update(ep_group=list(groups.ep.ranks), ep_rank=ep.rank, errors=errors)
    queue.put((rank, out))
    torch.distributed.destroy_process_group()


@pytest.mark.level(4)
def test_collectives_on_sub_groups_four_ranks(acc, accelerator_name, tmp_path):
    """`new_group` and the `group` argument: all_reduce, all_gather and uneven all_to_all within
    pairs of ranks, and the EP exchange in one EP group while the other group is idle."""
    results = dict(_run_two_ranks(acc, accelerator_name, tmp_path, _sub_group_worker, world=4))
    for rank, out in sorted(results.items()):
        first, me = rank - rank % 2, rank % 2
        assert out["reduced"] == [float(2 * first + 3)] * 2, "all_reduce on a sub-group summed the wrong ranks"
        assert out["gathered"] == [first, first + 1] and out["strided"] == [rank % 2, rank % 2 + 2]
        expected = [float((first + src) * 10 + me) for src in range(2) for _ in range(src + me + 1)]
        assert out["received"] == expected, "uneven all_to_all on a sub-group delivered the wrong rows"
        assert out["world"] == [4.0]
        assert out["ep_group"] == [first, first + 1] and out["ep_rank"] == me
        assert len(out["errors"]) == (2 if rank < 2 else 0)
        assert max(out["errors"], default=0.0) < 1e-4, f"rank {rank}: EP on a sub-group differs from local experts"


# ------------------------------------------------------------------------------------ level 5


@pytest.fixture(scope="module")
def tiny_checkpoint(request, tmp_path_factory) -> Path:
    """--checkpoint, else a tiny random DeepSeek-V4 checkpoint written to a temporary folder."""
    given = request.config.getoption("checkpoint")
    if given:
        return Path(given)
    from deepinfer.models.deepseek_v4.make_model import make_model
    return make_model(tmp_path_factory.mktemp("conformance") / "tiny", size="tiny", seed=3, progress=False)


def _greedy(model_dir, accelerator_name, prompts, max_model_len):
    from deepinfer import LLM, SamplingParams
    llm = LLM(model=str(model_dir), accelerator=accelerator_name, dtype="float32", max_model_len=max_model_len,
              max_num_seqs=4, seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.level(5)
def test_tiny_checkpoint_greedy_matches_the_reference(acc, accelerator_name, tiny_checkpoint):
    """The whole engine on this back end continues the checkpoint exactly like the same engine on
    the float64 reference kernels (fp32, greedy; 5, 17 and 40 prompt tokens: on the tiny DeepSeek-V4
    model they cross its window and compression boundaries)."""
    from deepinfer.testing.conformance import reference_registered
    family, config_dict = checkpoint_family(tiny_checkpoint)
    config = family.parse_config(config_dict, str(tiny_checkpoint))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, min(500, config.vocab_size), (n,), generator=g).tolist() for n in (5, 17, 40)]
    max_model_len = min(256, config.max_position_embeddings)
    got = _greedy(tiny_checkpoint, accelerator_name, prompts, max_model_len)
    with reference_registered() as reference:
        want = _greedy(tiny_checkpoint, reference, prompts, max_model_len)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"prompt {i}: greedy tokens differ from the reference kernels' at step " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
