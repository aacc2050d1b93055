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
@pytest.mark.parametrize("tokens, top_k", [(12, 4), (2, 1), (40, 2)])
def test_moe_experts_batched_and_looped_paths_match_the_definition(dtype, tokens, top_k):
    # (12, 4): every expert busy with few rows -> the batched path; (2, 1): few experts busy -> the
    # per-expert loop; (40, 2): more rows per expert than the skinny cut -> the loop's GEMMs
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
