"""DeepSeek-V4.1's op table on the cpu back end (`NativeCpuKernels.model_ops("deepseek_v41")`): its C
kernels for the single-pass mHC sites' entries, the fused attention projections without the per-head
query norm, the MXFP4 indexer, the decode attention over the FP8 window and NVFP4 entries and the cache
writes; batch-invariant mode's ops are a table of their own (fixed_order.py's `FixedOrderV41Ops`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, NVFP4_COMPRESSED, KVFormat
from deepinfer.models.deepseek_v41.ops import CandidateBlocks, DeepseekV41Ops
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.fixed_order import FixedOrderV41Ops
from deepinfer_plugins.cpu.program import V41_BINDERS

if TYPE_CHECKING:
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


class CpuDeepseekV41Ops(DeepseekV41Ops):
    """DeepSeek-V4.1's op table on the cpu back end: its C kernels (the single-pass mHC sites' entries, the
    fused attention projections without the per-head query norm, the MXFP4 indexer, the decode attention
    over the FP8 window and NVFP4 entries); in batch-invariant mode `FixedOrderV41Ops` installed over it."""

    program_binders = V41_BINDERS  # how the prepared programs bind its ops (program.py)
    fixed_order_ops = FixedOrderV41Ops  # its ops in batch-invariant mode (NativeKernelsBase.with_fixed_order)

    def __init__(self, kernels: NativeCpuKernels):
        super().__init__(kernels)
        self._site_sets = native.OutputSets(native.site_outputs, "pre")

    def _site_outputs(self, streams: torch.Tensor, pre_in: torch.Tensor) -> native.SiteOutputs | None:
        """The site calls' output buffers for decode-sized steps (native.OutputSets: never the set `pre_in` is
        in, as a site chain reads the previous call's results); None (new tensors) above
        tuning.hc_reuse_max_rows rows."""
        if streams.dim() != 3 or streams.shape[0] > self.kernels.tuning.hc_reuse_max_rows:
            return None
        return self._site_sets.other_than(streams, pre_in)

    def hc_mix_collapse_norm(self, streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor,
                             base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                             norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lib = self.kernels.native_library
        if lib is not None:  # hc_mix, hc_collapse and rms_norm in one C call
            out = native.hc_mix_collapse_norm(lib, streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                              norm_weight, rms_eps, self._site_outputs(streams, pre_in))
            if out is not None:
                return out.normed, out.pre, out.post, out.comb
        return super().hc_mix_collapse_norm(streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                            norm_weight, rms_eps)

    def hc_post_mix_collapse_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                                  comb: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                  scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                                  norm_weight: torch.Tensor, rms_eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lib = self.kernels.native_library
        if lib is not None:  # hc_post and the next site's entry in one C call
            out = native.run(lib, native.hc_post_mix_collapse_norm_arguments(
                y, streams, post, comb, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps,
                self._site_outputs(streams, pre_in)))
            if out is not None:
                return out
        return super().hc_post_mix_collapse_norm(y, streams, post, comb, pre_in, fn, base, scale, sinkhorn_iters, eps,
                                                 norm_eps, norm_weight, rms_eps)

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.kernels.hc_post(y, streams, post, comb)  # the C kernel: one token at a time

    def attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                              q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                              kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              index_heads: int = 0, index_cos: torch.Tensor | None = None,
                              index_sin: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = self.kernels.fused_attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos,
                                                       sin, index_heads, index_cos, index_sin, q_head_norm=False)
        if out is not None:
            return out
        return super().attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin,
                                             index_heads, index_cos, index_sin)

    def index_select(self, q: torch.Tensor, weights: torch.Tensor, weight_scale: float, index_keys: torch.Tensor,
                     rows: torch.Tensor, visible: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                     pool: CandidateBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # decode-sized queries in one C call (indexer.c): every query's scores, pool and picks, each key
        # decoded as it is read; prefill blocks keep the batched products
        kernels = self.kernels
        lib, out = kernels.native_library, None
        if lib is not None and q.dim() == 4 and q.shape[1] <= kernels.tuning.decode_queries:
            out = native.index_select(lib, q, weights, weight_scale, index_keys, rows, visible, k, candidates,
                                      None if pool is None else (pool.size, pool.keep, pool.rate, pool.positions))
        if out is not None:
            return out
        return super().index_select(q, weights, weight_scale, index_keys, rows, visible, k, candidates, pool)

    def decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                wo_b: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        k = self.kernels
        lib = k.native_library
        if lib is None:
            return super().decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                                   wo_b)
        # bf16 with the products the composed path would pick: one C call (attention_layer.c), V4's own
        out = k.fused_decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                              wo_b, coded_keys=True)
        if out is not None:
            return out
        # else the own keys' write and the attention over the packed keys in C (kv_cache.c, attention.c: the
        # bits of the decoded keys' attention), the output projections composed
        if native.kv_store(lib, kv, FP8_WINDOW, caches[0], key_rows):
            att = native.sink_attention_rows(lib, q.unsqueeze(1), caches, rows, masks, sinks, scale,
                                             (FP8_WINDOW, NVFP4_COMPRESSED)[:len(caches)])
            if att is not None:
                B = q.shape[0]
                o = k.rotary(att.squeeze(1), cos, sin, True).view(B, wo_a.shape[0], -1)
                return k.linear(k.grouped_linear(o, wo_a).reshape(B, -1), wo_b)
        # (the default stores the same codes again where kv_store did)
        return super().decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                               wo_b)

    def cache_store(self, x: torch.Tensor, fmt: KVFormat, cache: torch.Tensor, rows: torch.Tensor) -> None:
        lib = self.kernels.native_library  # one pass per row (kv_cache.c): the same bytes in every mode
        if lib is None or not native.kv_store(lib, x, fmt, cache, rows):
            super().cache_store(x, fmt, cache, rows)
