"""DeepSeek-V4's op table on the cpu back end (`CpuKernels.model_ops("deepseek_v4")`): each op is the
kernels object's method of the same name, so the native subclass's C kernels run where it has them, and
the fused attention ops fall back to the table's defaults where the C calls decline the input."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops

if TYPE_CHECKING:
    from deepinfer_plugins.cpu.kernels import CpuKernels


class CpuDeepseekV4Ops(DeepseekV4Ops):
    """DeepSeek-V4's op table on the cpu back end: each op is the kernels object's method of the same
    name (so the C kernels of the native subclass are used where it has them)."""

    def __init__(self, kernels: CpuKernels):
        super().__init__(kernels)

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)

    def hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.hc_pre_norm(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps)

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.kernels.hc_post(y, streams, post, comb)

    def hc_post_pre_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                         norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.hc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                             norm_weight, rms_eps)

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        return self.kernels.hc_head(streams, fn, base, scale, eps, norm_eps)

    def compress_store(self, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, position_mod: torch.Tensor,
                       ring_row: torch.Tensor, rows_kv: torch.Tensor, rows_score: torch.Tensor) -> None:
        if not self.kernels.compress_store(kv, score, ape, position_mod, ring_row, rows_kv, rows_score):
            super().compress_store(kv, score, ape, position_mod, ring_row, rows_kv, rows_score)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        return self.kernels.compress_pool(kv, score)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        return self.kernels.indexer_topk(q, weights, keys, mask, k)

    def attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                              q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                              kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              index_heads: int = 0, index_cos: torch.Tensor | None = None,
                              index_sin: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = self.kernels.fused_attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos,
                                                       sin, index_heads, index_cos, index_sin)
        if out is None:
            return super().attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin,
                                                 index_heads, index_cos, index_sin)
        return out

    def decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                                sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                wo_b: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        out = self.kernels.fused_decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin,
                                                         wo_a, wo_b)
        if out is None:
            return super().decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                                   wo_b)
        return out
