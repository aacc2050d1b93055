"""DeepSeek-V4.1's own fused ops: single-pass mHC on top of V4's op table.

V4.1 keeps V4's mHC coefficients (pre, post and the Sinkhorn-normalised comb of a site), its
expansion (`hc_post`) and the compressor's gated pooling (`compress_pool`), but splits V4's
`hc_pre` in two: a site computes its coefficients (`hc_mix`) while its sub-layer input is the
streams collapsed with the PREVIOUS site's `pre` (`hc_collapse`). There is no `hc_head`: the output
collapses with the last FFN site's `pre`.

`DeepseekV41Ops` is plain torch; a back end with faster versions subclasses it and returns an
instance from `Accelerator.model_ops("deepseek_v41")`.
"""
from __future__ import annotations

import torch

from deepinfer.models.common.op_table import check_op_signatures, resolve_op_table
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops

FAMILY = "deepseek_v41"
OPS = ("hc_mix", "hc_collapse", "hc_post", "compress_pool")


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


def resolve_ops(accelerator: object) -> DeepseekV41Ops:
    """The back end's V4.1 op table if it declares one (`model_ops("deepseek_v41")`), else the defaults."""
    return resolve_op_table(accelerator, FAMILY, DeepseekV41Ops)
