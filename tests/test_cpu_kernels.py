"""CPU kernels' fast paths against their plain definitions (the paths the conformance kit cannot
tell apart, because its reference is the CPU back end itself)."""
import pytest
import torch

from deepinfer_plugins.cpu.kernels import CpuKernels


def _per_expert(k: CpuKernels, rows, counts, w13, w2, limit):
    """The definition: one gate/up product, SwiGLU and down product per expert over its rows."""
    inter, out, start = w2.shape[2], [], 0
    for e, c in enumerate(counts):
        gate_up = rows[start:start + c].float() @ w13[e].float().t()
        h = k.swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
        out.append(h @ w2[e].float().t())
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, top_k", [(12, 4), (2, 1), (40, 2), (100, 2), (9, 2)])
def test_moe_experts_batched_and_looped_paths_match_the_definition(dtype, tokens, top_k):
    # (12, 4): every expert busy with few rows -> the batched path; (2, 1): few experts busy -> the
    # per-expert loop; (40, 2): skinny GEMMs in the loop; (100, 2): bucketed GEMMs that borrow
    # neighbouring experts' rows (forwards, and backwards for the last experts)
    k, g = CpuKernels(), torch.Generator().manual_seed(tokens)
    E, inter, D = 8, 16, 32
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=g) * 0.3).to(dtype)
    x = torch.randn(tokens, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    rows, plan = k.moe_dispatch(x, ids, E)
    got = k.moe_experts(rows, plan, w13, w2, 10.0)
    want = _per_expert(k, rows, plan.tokens_per_expert.tolist(), w13, w2, 10.0)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 17, 40, 64, 600])
def test_linear_paths_match_the_definition(rows):
    # 1: GEMV; 5: W @ x^T; 17, 40, 600: GEMM on a zero-padded bucket of rows; 64: a bucket exactly
    k, g = CpuKernels(), torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 48, generator=g).to(torch.bfloat16)
    w = torch.randn(24, 48, generator=g).to(torch.bfloat16)
    got = k.linear(x, w)
    want = x.float() @ w.float().t()
    assert got.shape == (2, rows, 24) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_grouped_linear_matches_one_linear_per_group(dtype, rows):
    k, g = CpuKernels(), torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4, 24, generator=g).to(dtype)
    w = torch.randn(4, 8, 24, generator=g).to(dtype)
    got = k.grouped_linear(x, w)
    want = torch.stack([x[:, i].float() @ w[i].float().t() for i in range(4)], dim=1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (rows, 4, 8) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def _attention_definition(q, kv, mask, sinks, scale):
    """Softmax over the visible keys plus one sink logit per head (which takes mass, adds no value)."""
    B, S, H, d = q.shape
    logits = torch.einsum("bshd,bld->bshl", q.double(), kv.double()) * scale
    logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
    full = torch.cat((logits, sinks.double().view(1, 1, H, 1).expand(B, S, H, 1)), dim=-1)
    return torch.einsum("bshl,bld->bshd", torch.softmax(full, dim=-1)[..., :-1], kv.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 3, 40])  # decode-sized bmm path and the prefill paths
@pytest.mark.parametrize("flash_lse", [True, False])  # prefill: sink from the log-sum-exp, or as a key
def test_sink_attention_paths_match_the_definition(dtype, queries, flash_lse, monkeypatch):
    from deepinfer_plugins.cpu import kernels

    if not flash_lse:
        monkeypatch.setattr(kernels, "_FLASH_WITH_LSE", None)
    elif kernels._FLASH_WITH_LSE is None:
        pytest.skip("this torch build has no flash attention op that returns the log-sum-exp")
    k, g = CpuKernels(), torch.Generator().manual_seed(queries)
    B, H, d, L = 3, 4, 16, 50
    q = torch.randn(B, queries, H, d, generator=g).to(dtype)
    kv = torch.randn(B, L, d, generator=g).to(dtype)
    mask = torch.rand(B, queries, L, generator=g) > 0.3
    mask[0, 0] = False  # a query that sees no key: all its mass goes to the sink, output 0
    sinks = torch.randn(H, generator=g)
    got = k.sink_attention(q, kv, mask, sinks, d ** -0.5)
    want = _attention_definition(q, kv, mask, sinks, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert got[0, 0].abs().max() == 0


def test_plain_kernels_op_table_stores_the_compressor_rows():
    """Without the C library (a plain CpuKernels), V4's op table still stores a step's compressor rows:
    its compress_store falls back to the op table's plain-torch default."""
    from deepinfer.models.deepseek_v4.ops import FAMILY as DEEPSEEK_V4, DeepseekV4Ops

    g = torch.Generator().manual_seed(5)
    kv, score, ape = (torch.randn(3, 8, generator=g) for _ in range(3))
    position_mod, ring_row = torch.tensor([1, 2, 0]), torch.tensor([4, 0, 5])
    got, want = [torch.zeros(6, 8) for _ in range(2)], [torch.zeros(6, 8) for _ in range(2)]
    CpuKernels().model_ops(DEEPSEEK_V4).compress_store(kv, score, ape, position_mod, ring_row, *got)
    DeepseekV4Ops().compress_store(kv, score, ape, position_mod, ring_row, *want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[0][4], kv[0]) and got[1].abs().sum() > 0
