"""indexer_scores and moe_route_rows, the top-k selections of a decode step (selection.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, f32, threads

_INDEXER_SCORES = Kernel("indexer_scores")
_MOE_ROUTE_ROWS = Kernel("moe_route_rows")


def indexer_scores(lib: ctypes.CDLL, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor | None:
    """`I[b, s, e] = sum_h weights[b, s, h] * relu(q[b, s, h] . keys[b, e])` in fp32, -inf where `mask`
    is False: q `[B, S, Hi, di]` and keys `[B, E, di]` of one dtype (fp32 or bf16), weights `[B, S, Hi]`,
    mask `[B, S, E]` bool. None for other input."""
    dtype = dtype_code(q)
    if (dtype is None or dtype_code(keys) != dtype or q.dim() != 4 or keys.dim() != 3 or weights.dim() != 3
            or mask.dtype is not torch.bool or not (weights.is_cpu and mask.is_cpu)):
        return None
    B, S, Hi, di = q.shape
    E = keys.shape[1]
    if keys.shape != (B, E, di) or weights.shape != (B, S, Hi) or mask.shape != (B, S, E):
        return None
    qc, kc, mc = q.contiguous(), keys.contiguous(), mask.contiguous()
    wc = f32(weights)
    out = torch.empty((B, S, E), dtype=torch.float32)
    if out.numel():
        _INDEXER_SCORES(lib, q=qc.data_ptr(), w=wc.data_ptr(), keys=kc.data_ptr(), mask=mc.data_ptr(),
                        out=out.data_ptr(), B=B, S=S, Hi=Hi, di=di, E=E, dtype=dtype, num_threads=threads())
    return out


def moe_route_rows(lib: ctypes.CDLL, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float,
                   hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's (weights `[T, k]` fp32, ids `[T, k]` int64) from fp32 scores `[T, E]` (see
    `moe_route`); None for other input or a hash id outside the experts (the reference then raises)."""
    if scores.dtype is not torch.float32 or scores.dim() != 2 or not scores.is_cpu or scores.requires_grad:
        return None
    T, E = scores.shape
    if not 0 < top_k <= E:
        return None
    if bias is not None and (bias.shape != (E,) or not bias.is_cpu):
        return None
    if hash_ids is not None and (hash_ids.shape != (T, top_k) or not hash_ids.is_cpu):
        return None
    sc = scores.contiguous()
    bc = None if bias is None else f32(bias)
    hc = None if hash_ids is None else hash_ids.long().contiguous()
    ids = torch.empty((T, top_k), dtype=torch.long)
    weights = torch.empty((T, top_k), dtype=torch.float32)
    status = _MOE_ROUTE_ROWS(lib, scores=sc.data_ptr(), bias=None if bc is None else bc.data_ptr(),
                             hash_ids=None if hc is None else hc.data_ptr(), ids=ids.data_ptr(),
                             weights=weights.data_ptr(), T=T, E=E, k=top_k, scaling=scaling)
    return None if status else (weights, ids)
