"""DeepSeek-V4.1's own fused ops: single-pass mHC on top of V4's op table.

V4.1 keeps V4's mHC coefficients (pre, post and the Sinkhorn-normalised comb of a site), its
expansion (`hc_post`) and the compressor's gated pooling (`compress_pool`), but splits V4's
`hc_pre` in two: a site computes its coefficients (`hc_mix`) while its sub-layer input is the
streams collapsed with the PREVIOUS site's `pre` (`hc_collapse`). There is no `hc_head`: the output
collapses with the last FFN site's `pre`. A site's whole entry is one op (`hc_mix_collapse_norm`,
with the sub-layer's RMSNorm), and between two sites the first one's `hc_post` joins it
(`hc_post_mix_collapse_norm`), as V4's `hc_post_pre_norm`.

The attention's own ops (attention.py): its input projections (`attention_projections`: V4's
without the query heads' norm), the lightning indexer over the MXFP4 index keys with the candidate
pool (`index_select`) and, for a step of decode tokens, the rest of the sub-layer in one op
(`decode_attention_output`: the own keys into the FP8 window ring, sink attention over the window and
the picked entries, the output projections), and the compressor's writes of its entries and index keys
(`cache_store`). The cache formats are kv_quant.py's, bit for bit.

`DeepseekV41Ops` is plain torch over the generic kernels of the back end it is made for (its
`kernels`: linears, norms, rotaries, sink attention); a back end with faster versions subclasses it
and returns an instance from `Accelerator.model_ops("deepseek_v41")`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.common.op_table import check_op_signatures, resolve_op_table
from deepinfer.models.common.ragged import take_rows
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, MXFP4_INDEX, NVFP4_COMPRESSED, KVFormat, decode, encode

FAMILY = "deepseek_v41"
OPS = ("hc_mix", "hc_collapse", "hc_post", "compress_pool", "hc_mix_collapse_norm", "hc_post_mix_collapse_norm",
       "attention_projections", "index_select", "decode_attention_output", "cache_store")


class CandidateBlocks(NamedTuple):
    """How the candidate source ranks its pool: blocks of `size` entries by their best score, the `keep`
    best kept, and always the block of each query's newest visible entry (its `(position + 1) // rate`
    entries are visible)."""

    size: int
    keep: int
    rate: int
    positions: torch.Tensor  # [B, S] int64: each query's position


class DeepseekV41Ops(DeepseekV4Ops):
    """Plain-torch defaults of V4.1's model-specific ops (V4's, plus single-pass mHC)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_op_signatures(DeepseekV41Ops, cls, OPS)

    def hc_mix(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One site's coefficients from the streams `[T, n, D]` arriving at it: (pre `[T, n]`,
        post `[T, n]`, comb `[T, n, n]`), fp32."""
        return self._hc_coefficients(streams.float(), fn, base, scale, sinkhorn_iters, eps, norm_eps)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """`sum_k pre_k * X_k` -> `[T, D]` in streams' dtype (fp32 products and sum)."""
        return torch.bmm(pre.float().unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)

    def hc_mix_collapse_norm(self, streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor,
                             base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                             norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A site's entry: its coefficients (`hc_mix` of `streams` `[T, n, D]`) and its sub-layer's input,
        the streams collapsed with the previous site's `pre_in` `[T, n]` (`hc_collapse`) and RMS-normalised
        by the back end's `rms_norm` (`norm_weight` `[D]`, `rms_eps`) -> (normed `[T, D]`, pre, post, comb).
        The results may be buffers the back end reuses: valid until its second call of these two ops after
        this one (the next call reads them, the site chain's use)."""
        pre, post, comb = self.hc_mix(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        normed = self.kernels.rms_norm(self.hc_collapse(streams, pre_in), norm_weight, rms_eps)
        return normed, pre, post, comb

    def hc_post_mix_collapse_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                                  comb: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                  scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                                  norm_weight: torch.Tensor, rms_eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Between two sites: `hc_post` of the first (y, streams, post, comb), then `hc_mix_collapse_norm` of
        the second (pre_in ... rms_eps) on its result -> (streams, normed, pre, post, comb). Buffers as there."""
        streams = self.hc_post(y, streams, post, comb)
        return (streams, *self.hc_mix_collapse_norm(streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                                    norm_weight, rms_eps))

    # ----- attention -----
    def attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                              q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                              kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              index_heads: int = 0, index_cos: torch.Tensor | None = None,
                              index_sin: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The attention's input projections of x `[T, D]`: `px = fused_x(x)` (wq_a, wkv, then the rest),
        `pqr = fused_qr(rms_norm(px[:, :rank], q_norm))` (wq_b, then the indexer's), the query heads
        `q = rotary(pqr[:, :heads d])` `[T, heads, d]` (no per-head norm), the window key
        `kv = rotary(rms_norm(px[:, rank:rank + d], kv_norm))` `[T, d]` and, with `index_heads`, the indexer
        queries `rotary(pqr[:, heads d:])` `[T, index_heads, di]` at the index tables -> (px, q, kv, iq or None)."""
        k = self.kernels
        T, d = x.shape[0], kv_norm.shape[0]
        px = k.linear(x, fused_x)
        pqr = k.linear(k.rms_norm(px[:, :rank], q_norm, eps), fused_qr)
        q = k.rotary(pqr[:, :heads * d].reshape(T, heads, d), cos, sin, False)
        kv = k.rms_norm_rotary(px[:, rank:rank + d], kv_norm, eps, cos, sin)
        iq = None
        if index_heads:
            iq = k.rotary(pqr[:, heads * d:].reshape(T, index_heads, -1), index_cos, index_sin, False)
        return px, q, kv, iq

    def index_select(self, q: torch.Tensor, weights: torch.Tensor, weight_scale: float, index_keys: torch.Tensor,
                     rows: torch.Tensor, visible: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                     pool: CandidateBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lightning indexer's picks for queries `q` `[B, S, Hi, di]` (rounded to MXFP4 here) with head
        weights `weights * weight_scale` (`weights` `[B, S, Hi]`, their projection) over entry e of sequence b,
        whose MXFP4 index key is `index_keys[rows[b, e]]` (`rows` `[B, E]`): `score = sum_h w_h relu(q_h . k)`
        in fp32 where `visible` `[B, S, E]`. With `pool` (the candidate source) it also returns its candidate
        pool `[B, S, E]` bool; with `candidates` (an index source after it) only entries in that pool are
        picked. Picks `[B, S, k]`: the min(k, E) best visible entries (ties: the older), sorted by position,
        -1 after them."""
        B, S, Hi, di = q.shape
        E = rows.shape[1]
        if E == 0:
            return torch.full((B, S, k), -1, dtype=torch.long, device=q.device), None if pool is None else visible
        index_q = decode(encode(q, MXFP4_INDEX), MXFP4_INDEX, di, torch.float32)
        keys = decode(take_rows(index_keys, rows), MXFP4_INDEX, di, torch.float32)
        dots = torch.einsum("bshd,bed->bshe", index_q, keys).relu_()
        scores = _pairwise_head_sum(dots * (weights.float() * weight_scale).unsqueeze(-1))  # [B, S, E]
        scores = scores.masked_fill(~visible, float("-inf"))
        pooled = None
        if pool is not None:
            pooled = _candidate_pool(scores, visible, pool)
        elif candidates is not None:
            scores = scores.masked_fill(~candidates, float("-inf"))
        kk = min(k, E)
        # a stable sort, not topk: exact score ties (common with MXFP4 index keys) then go to the
        # older entry, whatever the padded entry count (i.e. the batch) is
        top = scores.sort(dim=-1, descending=True, stable=True)
        picks = torch.where(torch.isfinite(top.values[..., :kk]), top.indices[..., :kk], -1)
        # sorted by position, the -1s last
        picks = torch.where(picks < 0, E, picks).sort(dim=-1).values
        picks = torch.where(picks >= E, -1, picks)
        if kk < k:
            picks = F.pad(picks, (0, k - kk), value=-1)
        return picks, pooled

    def decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                wo_b: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """The rest of the attention sub-layer for one decode token per sequence (q `[B, H, d]`, their own
        keys kv `[B, d]`): the own keys FP8-encoded into the window ring `caches[0]` (`[n, FP8 bytes]`) at
        `key_rows` `[B]`, sink attention over the window keys `caches[0][rows[0]]` and, as a second part, the
        NVFP4 entries `caches[1][rows[1]]` (each decoded to q's dtype; masks `[B, 1, L]`), the inverse rotary,
        the grouped `wo_a` (`[G, R, H d / G]`) and `wo_b` -> `[B, D]`."""
        k = self.kernels
        B, H, d = q.shape
        caches[0].index_copy_(0, key_rows, encode(kv, FP8_WINDOW))
        keys = decode(take_rows(caches[0], rows[0]), FP8_WINDOW, d, q.dtype)
        mask = masks[0]
        if len(caches) == 2:
            keys = torch.cat((keys, decode(take_rows(caches[1], rows[1]), NVFP4_COMPRESSED, d, q.dtype)), dim=1)
            mask = torch.cat((mask, masks[1]), dim=2)
        out = k.sink_attention(q.unsqueeze(1), keys, mask, sinks, scale).squeeze(1)
        o = k.rotary(out, cos, sin, True).view(B, wo_a.shape[0], -1)
        return k.linear(k.grouped_linear(o, wo_a).reshape(B, -1), wo_b)

    def cache_store(self, x: torch.Tensor, fmt: KVFormat, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """`cache[rows] = encode(x, fmt)`: rows `x` `[N, C]` in one of the cache formats (kv_quant.py, its bytes
        exactly) into the uint8 `cache` `[n, fmt.bytes_per_vector(C)]` at `rows` `[N]` (a compressor's
        published entries and index keys)."""
        cache[rows] = encode(x, fmt)


def _pairwise_head_sum(products: torch.Tensor) -> torch.Tensor:
    """`products` `[B, S, H, E]` summed over the heads in a fixed order: neighbours added pairwise, an odd
    count's last head carried to the next round. `.sum` adds in an order that depends on the CPU's vector
    width and the entry count; this one a kernel can reproduce, so its picks are this default's exactly."""
    while products.shape[2] > 1:
        n = products.shape[2]
        pairs = products[:, :, 0:n - 1:2] + products[:, :, 1:n:2]
        products = torch.cat([pairs, products[:, :, n - 1:]], dim=2) if n % 2 else pairs
    return products[:, :, 0]


def _candidate_pool(scores: torch.Tensor, visible: torch.Tensor, pool: CandidateBlocks) -> torch.Tensor:
    """`[B, S, E]` bool: the visible entries in the best blocks (by max score), the newest block always kept."""
    bs, E = pool.size, scores.shape[-1]
    padded = F.pad(scores, (0, -E % bs), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, bs)).amax(dim=-1)  # [B, S, nb]
    newest = (((pool.positions + 1) // pool.rate - 1) // bs).unsqueeze(-1)
    ids = torch.arange(block_scores.shape[-1], device=scores.device)
    block_scores = block_scores.masked_fill(ids == newest, float("inf"))
    nbest = min(pool.keep, block_scores.shape[-1])
    best = block_scores.sort(dim=-1, descending=True, stable=True)  # ties: the older block, as the picks
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter(-1, best.indices[..., :nbest],
                                                                    best.values[..., :nbest] > float("-inf"))
    return keep.repeat_interleave(bs, dim=-1)[..., :E] & visible


def resolve_ops(accelerator: object) -> DeepseekV41Ops:
    """The back end's V4.1 op table if it declares one (`model_ops("deepseek_v41")`), else the defaults
    over its generic kernels."""
    return resolve_op_table(accelerator, FAMILY, DeepseekV41Ops)
