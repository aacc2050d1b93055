"""A test-only CPU stand-in for torch_npu: the ops deepinfer's Ascend back end calls, nothing else.

Never installed: tests put `tests/fake_torch_npu` on sys.path (so there is no torch.backends
auto-load entry point, which would import it with torch). Each op follows the signature and the semantics documented
in torch_npu's `_op_plugin_docs.py` (Ascend/op-plugin, codegen/templates/_op_plugin_docs.py) and
the CPU golden references of op-plugin's tests, written here as plain torch, and rejects the
dtypes/shapes the documentation rules out, so that the back end's gating is exercised. Ops run on
CPU tensors (no device rename). Passing tests against this file prove the plumbing (argument
order, layouts, index conventions, fallbacks); they say nothing about Ascend numerics or speed.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__version__ = "2.13.0"
FAKE = True

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"fake torch_npu: {message}")


# ----------------------------------------------------------------------------- runtime namespace

def _get_device_name(device=None) -> str:
    return "Ascend950PR"


npu = types.SimpleNamespace(
    get_device_name=_get_device_name,
    device_count=lambda: 1,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    mem_get_info=lambda device=None: (48 << 30, 64 << 30),
    get_soc_version=lambda: 260,
)


# ----------------------------------------------------------------------------- small ops

def npu_rms_norm(self, gamma, epsilon=1e-06):
    """-> (y, rstd). self 2-8 dims fp16/bf16/fp32, gamma of the same dtype."""
    _require(self.dtype in _FLOAT and 2 <= self.dim() <= 8, "npu_rms_norm: x must be 2-8-D fp16/bf16/fp32")
    _require(gamma.dtype == self.dtype, "npu_rms_norm: gamma dtype must equal x dtype")
    xf = self.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(self.dtype), rstd


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """4-D input; interleave: output = r1 * x + r2 * rotate_pairs(x), rotate_pairs = (-x2, x1) per pair."""
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul: 4-D tensors only")
    _require(rotate is None, "npu_rotary_mul: rotate matrix not modelled")
    if rotary_mode == "interleave":
        x1, x2 = input[..., ::2], input[..., 1::2]
        x_new = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = input.chunk(2, dim=-1)
        x_new = torch.cat((-x2, x1), dim=-1)
    return r1 * input + r2 * x_new


def npu_swiglu(self, dim=-1):
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    _require(x.dim() > 1 and x.shape[dim] % 2 == 0, "npu_clipped_swiglu: x must be >1-D with an even split dim")
    _require(group_index is None, "npu_clipped_swiglu: group_index not modelled")
    xt = x.movedim(dim, -1)
    a, b = (xt[..., ::2], xt[..., 1::2]) if interleaved else xt.chunk(2, dim=-1)
    a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    return (a * torch.sigmoid(alpha * a) * (b + bias)).movedim(-1, dim)


# ----------------------------------------------------------------------------- mHC (Ascend 950 ops)

def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    """-> (h_in, h_post, h_res (before Sinkhorn), inv_rms, h_mix, h_pre); x [T, n, D] bf16/fp16."""
    _require(x.dtype in _HALF, "npu_mhc_pre: x must be bf16/fp16")
    _require(phi.dtype == alpha.dtype == bias.dtype == torch.float32, "npu_mhc_pre: phi/alpha/bias must be fp32")
    T, n, D = x.shape
    _require(phi.shape == (n * n + 2 * n, n * D), "npu_mhc_pre: phi must be [n^2+2n, nD]")
    flat = x.reshape(T, n * D).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    h_mix = F.linear(flat * gamma.reshape(-1).float() if gamma is not None else flat, phi)
    pre, post, res = (h_mix * inv_rms).split([n, n, n * n], dim=-1)
    h_pre = torch.sigmoid(pre * alpha[0] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(post * alpha[1] + bias[n:2 * n])
    h_res = res.unflatten(-1, (n, n)) * alpha[2] + bias[2 * n:].view(n, n)
    h_in = (h_pre.unsqueeze(-1) * flat.view(T, n, D)).sum(1).to(x.dtype)
    return h_in, h_post, h_res, inv_rms[:, 0], h_mix, h_pre


def npu_mhc_sinkhorn(x, *, eps=1e-6, num_iters=20, out_flag=0):
    """-> (y, norm_out, sum_out); x [..., n, n] fp32, n in {4, 6, 8}."""
    _require(x.dtype == torch.float32 and x.shape[-1] in (4, 6, 8), "npu_mhc_sinkhorn: fp32, n in {4, 6, 8}")
    _require(1 <= num_iters <= 100, "npu_mhc_sinkhorn: num_iters in [1, 100]")
    y = torch.softmax(x, dim=-1) + eps
    y = y / (y.sum(dim=-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
        y = y / (y.sum(dim=-2, keepdim=True) + eps)
    return y, torch.zeros(()), torch.zeros(())


def npu_mhc_post(x, h_res, h_out, h_post):
    """x_{l+1}[k] = sum_j h_res[j, k] x[j] + h_post[k] * h_out; x [T, n, D] bf16/fp16."""
    _require(x.dtype in _HALF and h_out.dtype == x.dtype, "npu_mhc_post: x and h_out must be bf16/fp16")
    _require(h_post.dtype == torch.float32 and (h_res is None or h_res.dtype == torch.float32),
             "npu_mhc_post: h_res/h_post must be fp32")
    mixed = x.float() if h_res is None else torch.einsum("tjk,tjd->tkd", h_res, x.float())
    return (mixed + h_post.unsqueeze(-1) * h_out.float().unsqueeze(-2)).to(x.dtype)


# ----------------------------------------------------------------------------- attention

def npu_fused_infer_attention_score_v2(query, key, value, *, atten_mask=None, num_query_heads=1,
                                       num_key_value_heads=0, softmax_scale=1.0, input_layout="BSH",
                                       sparse_mode=0, inner_precise=0, return_softmax_lse=False,
                                       learnable_sink=None, **unmodelled):
    """BSND only here. atten_mask True = masked out. -> (out, lse [B, N, S, 1] or [1])."""
    _require(not any(v is not None for v in unmodelled.values()), f"fia_v2: unmodelled args {list(unmodelled)}")
    _require(input_layout == "BSND" and sparse_mode == 0, "fia_v2: only BSND with sparse_mode 0 is modelled")
    _require(query.dtype in _HALF and key.dtype == value.dtype == query.dtype, "fia_v2: q/k/v must be fp16/bf16")
    B, S, N, D = query.shape
    kvn = num_key_value_heads or N
    _require(N == num_query_heads and key.shape[2] == kvn and N % kvn == 0 and N // kvn <= 64,
             "fia_v2: head counts (ratio <= 64)")
    _require(D <= 512 and value.shape[-1] == D, "fia_v2: D <= 512, equal for q/k/v")
    _require(S == 1 and inner_precise in (0, 1) or S > 1, "fia_v2: inner_precise must be 0/1 when Q_S == 1")
    k = key.float().repeat_interleave(N // kvn, dim=2)
    v = value.float().repeat_interleave(N // kvn, dim=2)
    scores = torch.einsum("bsnd,blnd->bnsl", query.float(), k) * softmax_scale
    if atten_mask is not None:
        _require(atten_mask.dtype == torch.bool and atten_mask.shape == (B, 1, S, k.shape[1]),
                 "fia_v2: bool mask [B, 1, S, KV_S] expected")
        scores = scores.masked_fill(atten_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, N, S, 1]; -inf for fully masked rows
    out = torch.einsum("bnsl,blnd->bsnd", torch.exp(scores - lse), v)  # NaN for fully masked rows:
    # the documentation leaves them undefined without row-invalid correction, so model the worst case
    return out.to(query.dtype), (lse if return_softmax_lse else torch.zeros(1))


# ----------------------------------------------------------------------------- MoE

def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                            expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(),
                            row_idx_type=0):
    """Dropless, unquantised: rows sorted stably by expert id.
    -> (expanded_x, expanded_row_idx int32, expert_token_count int64, expanded_scale)."""
    _require(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.dtype == torch.int32,
             "init_routing_v2: x [rows, H], expert_idx [rows, K] int32")
    _require(drop_pad_mode == 0 and quant_mode == -1 and scale is None, "init_routing_v2: only dropless, unquantised")
    _require(expert_tokens_num_type in (1, 2) and expert_tokens_num_flag, "init_routing_v2: count output required")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    key = torch.where(in_range, flat, torch.full_like(flat, torch.iinfo(torch.int32).max))
    order = torch.argsort(key, stable=True)
    total = int(in_range.sum())
    active = total if active_num <= 0 else min(active_num, total)
    expanded_x = x[order[:active] // k]
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
    else:  # gather type: for every flat choice, its expanded row (-1 when out of range)
        row_idx = torch.full_like(flat, -1)
        row_idx[order[:total]] = torch.arange(total)
        row_idx = row_idx.to(torch.int32)
    counts = torch.bincount(flat[in_range] - start, minlength=end - start).to(torch.int64)
    _require(expert_tokens_num_type == 1, "init_routing_v2: key_value counts not modelled")
    return expanded_x, row_idx, counts, torch.zeros(0)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """Only the single-x / single-3-D-weight / single-y case (group_type 0, split_item 2/3):
    y[rows of group g] = x[rows of group g] @ weight[g]."""
    _require(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, "gmm: single x, single 3-D weight only")
    _require(group_type == 0 and split_item in (2, 3), "gmm: group_type 0 with split_item 2/3 required")
    _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64, "gmm: int64 tensor group_list")
    _require(all(a is None for a in (bias, scale, offset, antiquant_scale, per_token_scale)) and act_type == 0,
             "gmm: quantisation/bias/activation not modelled")
    a, w = x[0], weight[0]
    _require(a.dtype in _FLOAT and w.dtype == a.dtype, "gmm: x/weight fp16/bf16/fp32 of one dtype")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    sizes = sizes.tolist()
    _require(sum(sizes) == a.shape[0] and len(sizes) == w.shape[0], "gmm: group sizes must cover x and match weight")
    y = a.new_empty((a.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        y[start:start + n] = (a[start:start + n].float() @ w[g].float()).to(a.dtype)
        start += n
    return [y]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """out[i] = skip1 + skip2 + sum_j scales[i, j] * (rows[src_to_dst[i + j * NUM_ROWS]] + bias[expert])."""
    rows = expanded_permuted_rows
    _require(rows.dtype in _FLOAT and expanded_src_to_dst_row.dtype == torch.int32, "finalize: dtypes")
    _require(skip2 is None or skip1 is not None, "finalize: skip2 needs skip1")
    _require(bias is None or export_for_source_row is not None, "finalize: bias needs expert ids")
    K = scales.shape[1] if scales is not None else k
    T = rows.shape[0] // K
    picked = rows[expanded_src_to_dst_row.long()].view(K, T, -1).transpose(0, 1)  # [T, K, H]
    if bias is not None:
        picked = picked + bias[export_for_source_row.long()]
    w = scales.to(rows.dtype).unsqueeze(-1) if scales is not None else 1
    out = (picked * w).sum(1)
    for skip in (skip1, skip2):
        out = out + skip if skip is not None else out
    return out
