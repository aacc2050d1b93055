"""`sink_attention` through FlashMLA's sparse MQA kernel (deepseek-ai/FlashMLA, SM90/SM100).

The interface gives attention an explicit key set per sequence (`kv [B, L, d]`) and a visibility
mask (`mask [B, S, L]`). FlashMLA's `flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink,
topk_length)` takes exactly that shape of problem: every query row lists the key rows it attends to
(`indices`, -1 = none), K and V are the same tensor (d_v = d_qk = 512 is DeepSeek-V4's shared-KV
layout), and `attn_sink` rescales the output by exp(lse) / (exp(lse) + exp(sink)), which is the
interface's "sink logit in the softmax denominator". A query row with no key gets output 0 in both.

The FP8 paged decode kernel (`flash_mla_with_kvcache(..., indices=...)`) would need the engine's
cache in FlashMLA's FP8 byte layout; the interface hands over bf16 keys, so the bf16 sparse kernel
is the one that fits. It runs for decode and prefill alike.

Only `flash_mla` itself is imported lazily, in `FlashMlaAttention.__init__`, so that this module can
be imported and its index construction tested on a CPU-only machine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: what the kernel accepts (csrc/api/sparse_fwd.h): bf16, h_q in {64, 128}, d_qk in {512, 576}, d_v 512.
SUPPORTED_HEADS = (64, 128)
SUPPORTED_HEAD_DIM = 512  # K = V shares the 512 dims, so d_qk must equal d_v here
#: index lists are padded to a multiple of the kernel's key block (B_TOPK = 128 for h_q = 128)
TOPK_MULTIPLE = 128


def sparse_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a `[B, S, L]` visibility mask into FlashMLA's per-query key lists.

    Returns (indices `[B*S, 1, Lp]` int32, row indices into the flattened `[B*L]` key tensor, visible
    keys first in key order, -1 after; topk_length `[B*S]` int32, the number of visible keys).
    Lp is L rounded up to `TOPK_MULTIPLE`. No host synchronisation (usable under graph capture)."""
    B, S, L = mask.shape
    order = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices  # visible first
    visible = torch.gather(mask, -1, order)
    base = (torch.arange(B, device=mask.device) * L).view(B, 1, 1)
    rows = torch.where(visible, order + base, torch.full_like(order, -1)).to(torch.int32)
    padded = -(-max(L, 1) // TOPK_MULTIPLE) * TOPK_MULTIPLE
    rows = F.pad(rows, (0, padded - L), value=-1)
    return rows.reshape(B * S, 1, padded), mask.sum(-1, dtype=torch.int32).reshape(B * S)


def eligible(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel supports these inputs; otherwise the generic path runs."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and kv.shape[1] > 0
            and q.shape[2] in SUPPORTED_HEADS and q.shape[3] == SUPPORTED_HEAD_DIM and kv.shape[-1] == q.shape[3])


class FlashMlaAttention:
    """Callable with the `sink_attention` signature, backed by `flash_mla.flash_mla_sparse_fwd`."""

    def __init__(self) -> None:
        import flash_mla  # noqa: PLC0415 - the fast path is optional; imported only when selected

        self._sparse_fwd = flash_mla.flash_mla_sparse_fwd

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                 scale: float) -> torch.Tensor:
        B, S, H, d = q.shape
        L = kv.shape[1]
        indices, lengths = sparse_indices(mask)
        out, _max_logits, _lse = self._sparse_fwd(
            q.reshape(B * S, H, d).contiguous(), kv.reshape(B * L, 1, d).contiguous(), indices, float(scale),
            d_v=d, attn_sink=sinks.float().contiguous(), topk_length=lengths)
        return out.view(B, S, H, d)
