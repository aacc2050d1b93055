"""The cpu back end's batch-invariant mode as tables of its own (docs/batch_invariance.md).

In batch-invariant mode (`set_batch_invariant(True)`, the batch_invariant feature; needs the C library)
a row's result is the same bits alone, in any batch, in any prefill chunk or at decode. Every product
(linears, grouped projections, experts, mHC mixes, indexer scores) then runs through one fixed-order C
dot product whatever the row count (`native.linear_rows`), every attention call through the C attention
with each sequence's keys in a canonical order (`native.sink_attention_invariant`), and the element-wise
and per-row kernels (norms, rotary, swiglu, mHC `hc_post`, MoE route and combine, argmax/log-sum-exp)
through the C kernels, which already reduce each row on its own.

`FixedOrderKernels` (for the kernels object) and `FixedOrderV41Ops` (for DeepSeek-V4.1's op table) hold
the ops that differ in this mode; `install` puts a table's ops over its target's methods of the same
names (instance attributes, so the target's other methods, and the composed ops, call them) and takes
them away again. The fast paths' methods then never ask which mode they are in. An op written as
`composed(Base.op)` is the reference composition run on the target: its parts are the ones installed.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.kernels import CpuKernels

if TYPE_CHECKING:
    from deepinfer.accelerator.interface import MoEDispatch
    from deepinfer_plugins.cpu.native_base import NativeKernelsBase


def lanewise(op, x: torch.Tensor) -> torch.Tensor:
    """`op` (an element-wise torch function) of `x` with every element on torch's vector path. torch
    computes the last elements of a tensor and of each thread's share (up to 31 with AVX-512) with the
    scalar libm function, which may differ from the vector one in the last bit; zero padding to a multiple
    of 64 elements per thread keeps an element's bits independent of the tensor's size."""
    flat = x.reshape(-1)
    pad = -flat.numel() % (64 * torch.get_num_threads())
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return op(flat)[:x.numel()].view(x.shape)


def row_strided(y: torch.Tensor) -> torch.Tensor:
    """`y` (values unchanged) as a view whose rows are apart by more than their width when that width is
    not a multiple of 64 elements. torch runs an element-wise op over a contiguous tensor as one flat loop
    of two vectors a step (32 floats with AVX-512) whose last elements take the scalar libm path; over
    rows that cannot be merged it loops row by row, so every row takes the same path whatever the row
    count. The model's own element-wise math on narrow products (the router's softplus over 8, 16 or 48
    experts) then stays batch-invariant."""
    width = y.shape[-1]
    if width % 64 == 0 or y.dim() < 2:
        return y
    padded = y.new_empty((*y.shape[:-1], width + 16))
    padded[..., :width] = y
    return padded[..., :width]


def sum_fixed(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over a short `dim` as one add after another, in index order (keepdim)."""
    total = x.narrow(dim, 0, 1).clone()
    for i in range(1, x.shape[dim]):
        total += x.narrow(dim, i, 1)
    return total


def composed(method: Callable[..., Any]) -> Callable[..., Any]:
    """A table op that is `method` (a base class's reference composition) run on the table's target."""
    def op(self, *args: Any, **kwargs: Any) -> Any:
        return method(self.target, *args, **kwargs)
    op.__name__, op.__doc__ = method.__name__, f"The composed {method.__qualname__}, over this mode's ops."
    return op


def declined(*args: Any, **kwargs: Any) -> None:
    """A fused op that does not run in this mode (None: the caller composes it)."""
    return None


class FixedOrderTable:
    """A table of ops for one target object; `ops` are the names `install` puts over the target's."""

    ops: tuple[str, ...] = ()

    def __init__(self, target: Any):
        self.target = target


def install(target: Any, table_class: type[FixedOrderTable], enabled: bool) -> FixedOrderTable | None:
    """A `table_class` for `target` with its ops put over the target's methods of the same names (enabled),
    or the target's own methods again (None)."""
    table = table_class(target) if enabled else None
    for name in table_class.ops:
        if table is None:
            target.__dict__.pop(name, None)
        else:
            target.__dict__[name] = getattr(table, name)
    return table


class FixedOrderKernels(FixedOrderTable):
    """The kernels object's ops in batch-invariant mode (see the module doc)."""

    ops = ("linear", "grouped_linear", "swiglu", "sink_attention", "sink_attention_rows", "indexer_topk",
           "compress_pool", "hc_pre", "hc_pre_norm", "hc_post_pre_norm", "hc_head", "moe_route", "moe_experts",
           "moe_sublayer", "fused_attention_projections", "fused_decode_attention_output", "prepare_program")
    target: NativeKernelsBase

    # the fused sub-layers and the prepared programs run as their parts: the ones below, the fixed-order kernels
    fused_attention_projections = staticmethod(declined)
    fused_decode_attention_output = staticmethod(declined)
    prepare_program = staticmethod(declined)
    hc_pre_norm = composed(CpuKernels.hc_pre_norm)
    hc_post_pre_norm = composed(CpuKernels.hc_post_pre_norm)
    moe_sublayer = composed(CpuKernels.moe_sublayer)
    sink_attention_rows = composed(CpuKernels.sink_attention_rows)

    def rows(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The fixed-order product `x @ weight^T`, every output reduced in one order whatever the row count."""
        if weight.dtype != x.dtype and out_dtype is None:
            weight = weight.to(x.dtype)  # rounded like the default path
        y = native.linear_rows(self.target.native_library, x, weight, out_dtype)
        if y is None:
            raise RuntimeError(f"batch-invariant mode: no fixed-order product for x {x.dtype} {tuple(x.shape)} and "
                               f"weight {weight.dtype} {tuple(weight.shape)} on {x.device} (fp32 or bf16 CPU "
                               f"tensors only); disable the batch_invariant feature for this model")
        return y

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):  # dequantised tile by tile, each tile through this linear
            return CpuKernels.linear(self.target, x, weight)
        return row_strided(self.rows(x, weight))

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):  # one (tiled) linear per group
            return CpuKernels.grouped_linear(self.target, x, weight)
        return torch.stack([self.rows(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        # always C, even for a few rows: torch computes the last few elements of a tensor with the scalar
        # exp, the others with the vector one, so an element's bits would depend on the tensor's size
        out = native.swiglu(self.target.native_library, gate, up, limit)
        return CpuKernels.swiglu(self.target, gate, up, limit) if out is None else out

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
        out = native.sink_attention_invariant(self.target.native_library, q, kv, mask, sinks, scale)
        if out is None:
            raise RuntimeError(f"batch-invariant mode: no canonical-order attention for q {q.dtype} "
                               f"{tuple(q.shape)}, kv {kv.dtype} {tuple(kv.shape)} (fp32 or bf16 CPU tensors)")
        return out

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                     k: int) -> torch.Tensor:
        if keys.shape[1] == 0:
            return CpuKernels.indexer_topk(self.target, q, weights, keys, mask, k)
        B, S, Hi, _ = q.shape
        kk = min(k, keys.shape[1])
        # per sequence: every (query, head, entry) score as a fixed-order dot product; the head sum in order
        dots = torch.stack([self.rows(q[b].float(), keys[b].float(), torch.float32) for b in range(B)]).relu_()
        w = weights.float()
        score = dots[:, :, 0] * w[:, :, 0, None]
        for h in range(1, Hi):
            score += dots[:, :, h] * w[:, :, h, None]
        score = score.masked_fill(~mask, float("-inf"))
        # ties (common with quantised keys) go to the lower entry index: topk breaks them differently
        # depending on the number of (padded) entries, i.e. on the batch
        idx = score.sort(dim=-1, descending=True, stable=True).indices[..., :kk]
        picks = torch.where(mask.gather(-1, idx), idx, torch.full_like(idx, -1))
        return picks if kk == k else torch.nn.functional.pad(picks, (0, k - kk), value=-1)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        # the softmax over the slots and the weighted sum, one slot after another
        score = score.float()
        top = score.amax(dim=-2, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all slots empty: weights 0
        e = lanewise(torch.exp, score - top)
        return (sum_fixed(e * kv.float(), -2) / sum_fixed(e, -2)).squeeze(-2)

    # ----- mHC -----
    def mix(self, streams_f: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """The RMS-normalised streams times fn, the mean square a fixed-order dot product with ones."""
        flat = streams_f.flatten(-2)
        ones = torch.ones((1, flat.shape[-1]), dtype=torch.float32)
        inv = torch.rsqrt(self.rows(flat.square(), ones, torch.float32) / flat.shape[-1] + norm_eps)
        return self.rows(flat, fn.float(), torch.float32).mul_(inv)

    def coefficients(self, streams_f: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     sinkhorn_iters: int, eps: float, norm_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC (pre, post, comb) with fixed-order sums and vector-path transcendentals (the math of
        `DeepseekV4Ops._hc_coefficients`); the C hc_pre reduces a row differently once the streams are
        wider than its 512-element chunks, depending on its row block."""
        n = streams_f.shape[1]
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        scale = scale.float()
        mixes = self.mix(streams_f, fn, norm_eps)
        pre = lanewise(torch.sigmoid, mixes[:, :n] * scale[0] + pre_b) + eps
        post = 2 * lanewise(torch.sigmoid, mixes[:, n:2 * n] * scale[1] + post_b)
        logits = mixes[:, 2 * n:].unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
        comb = lanewise(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
        comb = comb / sum_fixed(comb, -1) + eps
        comb = comb / (sum_fixed(comb, -2) + eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (sum_fixed(comb, -1) + eps)
            comb = comb / (sum_fixed(comb, -2) + eps)
        return pre, post, comb

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        streams_f = streams.float()
        pre, post, comb = self.coefficients(streams_f, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        return collapse(streams_f, pre).to(streams.dtype), post, comb

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        streams_f = streams.float()
        pre = lanewise(torch.sigmoid, self.mix(streams_f, fn, norm_eps) * scale.float() + base.float()) + eps
        return collapse(streams_f, pre).to(streams.dtype)

    # ----- MoE -----
    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
                  hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # always C, whatever the row count: a token's weights are then the same bits at any batch size
        k = self.target
        out = native.moe_route_rows(k.native_library, scores, bias, top_k, routed_scaling_factor, hash_ids)
        return CpuKernels.moe_route(k, scores, bias, top_k, routed_scaling_factor, hash_ids) if out is None else out

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        """Each expert's rows through the fixed-order product: a token's expert output does not depend
        on which other tokens chose that expert (the combine then sums a token's k outputs in slot order)."""
        if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):  # per expert, through linear
            return CpuKernels.moe_experts(self.target, rows, plan, w13, w2, swiglu_limit)
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype, device=rows.device)
        inter, start = w2.shape[2], 0
        for e, count in enumerate(plan.tokens_per_expert.tolist()):
            if count:
                gate_up = self.rows(rows[start:start + count], w13[e])
                hidden = self.swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
                out[start:start + count] = self.rows(hidden, w2[e])
            start += count
        return out


def collapse(streams_f: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`sum_k pre_k * X_k` of fp32 streams `[T, n, D]`, one stream after another -> `[T, D]` fp32."""
    return sum_fixed(streams_f * pre.float().unsqueeze(-1), -2).squeeze(-2)


class FixedOrderV41Ops(FixedOrderTable):
    """DeepSeek-V4.1's op table's ops in batch-invariant mode: the single-pass sites, the indexer and the
    decode attention composed (their parts then the fixed-order kernels'), the coefficients and the
    collapse with fixed-order sums, the pooling and top-k the kernels' (`FixedOrderKernels`)."""

    ops = ("hc_mix_collapse_norm", "hc_post_mix_collapse_norm", "hc_mix", "hc_collapse", "index_select",
           "decode_attention_output", "compress_pool", "indexer_topk")
    target: DeepseekV41Ops

    hc_mix_collapse_norm = composed(DeepseekV41Ops.hc_mix_collapse_norm)
    hc_post_mix_collapse_norm = composed(DeepseekV41Ops.hc_post_mix_collapse_norm)
    index_select = composed(DeepseekV41Ops.index_select)
    decode_attention_output = composed(DeepseekV41Ops.decode_attention_output)

    def hc_mix(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.target.kernels.fixed_order.coefficients(streams.float(), fn, base, scale, sinkhorn_iters, eps,
                                                            norm_eps)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return collapse(streams.float(), pre).to(streams.dtype)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        return self.target.kernels.compress_pool(kv, score)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                     k: int) -> torch.Tensor:
        return self.target.kernels.indexer_topk(q, weights, keys, mask, k)
