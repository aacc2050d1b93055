"""DeepSeek-V4's own fused ops: the op table the model calls for them.

The generic ops (linear, norms, rope, attention, MoE, sampling) come from the accelerator
interface. The ops below exist only because of V4's architecture — manifold-constrained
hyper-connections (mHC: `hc_pre`, `hc_pre_norm`, `hc_post`, `hc_post_pre_norm`, `hc_head`), the
compressor's ring writes and gated pooling (`compress_store`, `compress_pool`), the lightning
indexer's selection (`indexer_topk`), and the attention sub-layer's two halves in one call each
(`attention_projections`, `decode_attention_output`) — so they are not part of the accelerator
contract. `DeepseekV4Ops` implements them in plain torch (device-agnostic, fp32 reductions), or as
compositions of the accelerator's generic ops it is built with (`kernels`). A back end with
faster versions subclasses it, overrides what it has, and returns an instance from
`Accelerator.model_ops("deepseek_v4")`; the model resolves its table once, at construction
(`resolve_ops`). The model's decode steps name these ops in their programs (`core/program.py`),
which is where a back end binds its fused versions once instead of per call.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.common.op_table import check_op_signatures, resolve_op_table

#: the family name a back end's `model_ops(family)` is asked with
FAMILY = "deepseek_v4"

# Upper bound on elements of one indexer score block, ~256 MB of fp32.
_MAX_SCORE_ELEMENTS = 1 << 26


#: the ops of the table (what a back end may override)
OPS = ("hc_pre", "hc_pre_norm", "hc_post", "hc_post_pre_norm", "hc_head", "compress_store", "compress_pool",
       "indexer_topk", "attention_projections", "decode_attention_output")


class DeepseekV4Ops:
    """Plain-torch defaults of V4's model-specific ops, over the accelerator's generic ops `kernels`
    (linear, norms, rotary, attention) where an op composes them. A subclass that overrides one with
    other parameter names or kinds fails when it is defined (as accelerator kernels do)."""

    def __init__(self, kernels: Any = None):
        if kernels is None:  # plain torch, on whatever device the tensors are
            from deepinfer.accelerator.reference import TorchKernels
            kernels = TorchKernels()
        self.kernels = kernels

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_op_signatures(DeepseekV4Ops, cls, OPS)

    def _hc_mix(self, streams_f: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """RMS-normalised flattened streams times fn (the norm factor applied to the product)."""
        flat = streams_f.flatten(-2)
        inv = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        return F.linear(flat, fn.float()).mul_(inv)

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC mixing weights (pre, post, Sinkhorn-normalised comb) and the collapse `sum_j pre_j * X_j`.

        streams `[T, n, D]`; fn `[(2+n)n, nD]`, base `[(2+n)n]`, scale `[3]`, all fp32.
        Returns (collapsed `[T, D]` in streams' dtype, post `[T, n]` fp32, comb `[T, n, n]` fp32)."""
        sf = streams.float()
        pre, post, comb = self._hc_coefficients(sf, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        collapsed = torch.bmm(pre.unsqueeze(1), sf).squeeze(1).to(streams.dtype)  # sum_j pre_j * X_j
        return collapsed, post, comb

    def hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`hc_pre`, then the sub-layer's RMSNorm of the collapsed input (weight `norm_weight` `[D]`, eps
        `rms_eps`, in fp32 on the collapse rounded to streams' dtype) -> (normed `[T, D]`, post, comb).
        A back end fuses the two (one call per mHC site at decode)."""
        collapsed, post, comb = self.hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        xf = collapsed.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps) * norm_weight.float()
        return normed.to(collapsed.dtype), post, comb

    def _hc_coefficients(self, streams_f: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                         sinkhorn_iters: int, eps: float, norm_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre `[T, n]`, post `[T, n]`, comb `[T, n, n]`) of one mHC site, fp32 (streams_f fp32)."""
        n = streams_f.shape[1]
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        scale = scale.float()
        mixes = self._hc_mix(streams_f, fn, norm_eps)
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + post_b)
        comb = torch.softmax(mixes[:, 2 * n:].unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # columns once
        for _ in range(sinkhorn_iters - 1):  # then rows, columns (Sinkhorn)
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """mHC expansion: `X'_k = post_k * y + sum_j comb[j, k] * X_j` -> `[T, n, D]` in streams' dtype."""
        mixed = torch.bmm(comb.float().transpose(-1, -2), streams.float())
        return (mixed + post.float().unsqueeze(-1) * y.float().unsqueeze(1)).to(streams.dtype)

    def hc_post_pre_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                         norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Between two mHC sites: `hc_post` of the first (y, streams, post, comb), then `hc_pre_norm` of the
        second (fn ... rms_eps) on its result -> (streams, normed, post, comb). A back end fuses the two
        (one call between sub-layers at decode). It may write the results into buffers it reuses: they
        stay valid until its next call, which may take them as its inputs (the block loop's use)."""
        streams = self.hc_post(y, streams, post, comb)
        normed, post, comb = self.hc_pre_norm(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight,
                                              rms_eps)
        return streams, normed, post, comb

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        """Output-head collapse of the streams (no Sinkhorn, no post) -> `[T, D]`."""
        streams_f = streams.float()
        mixes = self._hc_mix(streams_f, fn, norm_eps)
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
        return (pre.unsqueeze(-1) * streams_f).sum(dim=-2).to(streams.dtype)

    def compress_store(self, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, position_mod: torch.Tensor,
                       ring_row: torch.Tensor, rows_kv: torch.Tensor, rows_score: torch.Tensor) -> None:
        """The compressor's raw rows of every token of the step into their ring rows, in place:
        `rows_kv[ring_row[t]] = kv[t]`, `rows_score[ring_row[t]] = score[t] + ape[position_mod[t]]` (fp32).

        kv, score `[T, w]`; ape `[m, w]` fp32; position_mod, ring_row `[T]` int64; rows_* `[R, w]` fp32."""
        rows_kv.index_copy_(0, ring_row, kv.to(rows_kv.dtype))
        with_ape = ape.index_select(0, position_mod).float().add_(score)
        rows_score.index_copy_(0, ring_row, with_ape.to(rows_score.dtype))

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Gated softmax pooling of compressor slots, per channel, in fp32.

        kv, score `[..., slots, d]` (score already includes the position bias; -inf = empty
        slot). Returns `[..., d]` fp32 = sum over slots of softmax(score) * kv."""
        weights = torch.softmax(score.float(), dim=-2)
        return (weights * kv.float()).sum(dim=-2)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        """Lightning-indexer selection.

        q `[B, S, Hi, di]`; weights `[B, S, Hi]` (already scaled); keys `[B, E, di]`;
        mask `[B, S, E]` bool (True = visible). Score `I[s, e] = sum_h w[h] * relu(q_h . k_e)`
        in fp32 (the 1/sqrt(di) scale is applied by the caller to q or w). Returns
        `[B, S, k]` int64 entry indices; picks on invisible entries are -1."""
        B, S, Hi, _ = q.shape
        E = keys.shape[1]
        if E == 0:
            return torch.full((B, S, k), -1, dtype=torch.long, device=q.device)
        keys_f = keys.float()
        kk = min(k, E)
        picks = torch.empty((B, S, kk), dtype=torch.long, device=q.device)
        step = max(1, min(S, _MAX_SCORE_ELEMENTS // max(B * Hi * E, 1)))
        for s0 in range(0, S, step):
            dots = torch.einsum("bshd,bed->bshe", q[:, s0:s0 + step].float(), keys_f).relu_()
            score = (dots * weights[:, s0:s0 + step].float().unsqueeze(-1)).sum(dim=2)
            m = mask[:, s0:s0 + step]
            idx = score.masked_fill(~m, float("-inf")).topk(kk, dim=-1).indices
            picks[:, s0:s0 + step] = torch.where(m.gather(-1, idx), idx, torch.full_like(idx, -1))
        if kk < k:
            picks = F.pad(picks, (0, k - kk), value=-1)
        return picks

    def attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                              q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                              kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              index_heads: int = 0, index_cos: torch.Tensor | None = None,
                              index_sin: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The attention's queries and key from its input x `[T, D]`: `px = linear(x, fused_x)`, whose
        first `rank` columns are the query's low-rank part and the next d its key (d = kv_norm's size,
        the head size); `pqr = linear(rms_norm(px[:, :rank], q_norm), fused_qr)`, whose first `heads * d`
        columns are the query heads and the rest (with `index_heads`) the indexer's query heads. Returns
        (px, q = rms_norm_rotary of the heads `[T, heads, d]` (no weight), kv = rms_norm_rotary of the key
        `[T, d]` (kv_norm), the indexer query heads rotated by (index_cos, index_sin) `[T, index_heads, .]`
        or None); cos/sin `[T, r/2]`. This default makes those generic calls; a back end fuses them."""
        k = self.kernels
        T, d = x.shape[0], kv_norm.shape[0]
        px = k.linear(x, fused_x)
        pqr = k.linear(k.rms_norm(px[:, :rank], q_norm, eps), fused_qr)
        q = k.rms_norm_rotary(pqr[:, :heads * d].reshape(T, heads, d), None, eps, cos, sin)
        kv = k.rms_norm_rotary(px[:, rank:rank + d], kv_norm, eps, cos, sin)
        index_q = None
        if index_heads:
            index_q = k.rotary(pqr[:, heads * d:].reshape(T, index_heads, -1), index_cos, index_sin, False)
        return px, q, kv, index_q

    def decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                                sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                wo_b: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """A decode step's attention from its keys to its output, one query per sequence: each query's
        own key `kv` `[B, d]` written into `caches[0]` at rows `key_rows` `[B]` (the window ring), then
        `sink_attention_rows` of q `[B, H, d]` over the parts (`caches`, `rows`, `masks` as there, S = 1),
        the inverse `rotary` (cos/sin `[B, r/2]`), the grouped output projection `wo_a` `[G, R, H*d/G]`
        and `linear` by `wo_b` `[D, G*R]` -> `[B, D]` in q's dtype. This default makes those generic
        calls; a back end fuses them (one call per layer instead of five and their glue)."""
        k = self.kernels
        caches[0].index_copy_(0, key_rows, kv)
        o = k.sink_attention_rows(q.unsqueeze(1), caches, rows, masks, sinks, scale).squeeze(1)
        o = k.rotary(o, cos, sin, True).view(q.shape[0], wo_a.shape[0], -1)
        return k.linear(k.grouped_linear(o, wo_a).reshape(q.shape[0], -1), wo_b)


def resolve_ops(accelerator: object) -> DeepseekV4Ops:
    """The back end's V4 op table if it declares one (`model_ops("deepseek_v4")`), else the defaults."""
    return resolve_op_table(accelerator, FAMILY, DeepseekV4Ops)
