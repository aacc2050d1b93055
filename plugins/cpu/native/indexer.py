"""index_select, DeepSeek-V4.1's lightning indexer over its MXFP4 index keys for a few queries per
sequence (indexer.c): scores, candidate pool and top-k picks in one call."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.models.deepseek_v41.kv_quant import MXFP4_INDEX
from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, threads
from deepinfer_plugins.cpu.native.kv_cache import codes_fit

_INDEX_SELECT = Kernel("index_select")


def _item_stride(t: torch.Tensor) -> int | None:
    """The element stride between the `[B, S]` items of `t` `[B, S, ...]` where each item's elements are
    contiguous and the items evenly spaced (a group's gather of a step's rows, or a column slice of
    them), else None."""
    B, S = t.shape[:2]
    size = 1
    for dim in range(t.dim() - 1, 1, -1):
        if t.stride(dim) != size and t.shape[dim] != 1:
            return None
        size *= t.shape[dim]
    item = t.stride(1) if S > 1 else (t.stride(0) if B > 1 else size)
    if B > 1 and S > 1 and t.stride(0) != S * item:
        return None
    return item if item >= size else None


def index_select(lib: ctypes.CDLL, q: torch.Tensor, weights: torch.Tensor, weight_scale: float,
                 index_keys: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, k: int,
                 candidates: torch.Tensor | None, pool: tuple[int, int, int, torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """DeepseekV41Ops.index_select (its arguments, `pool` as (block size, blocks kept, rate, query positions
    `[B, S]`)) in C: (picks `[B, S, k]`, the pool `[B, S, E]` or None), the default's bits (its scores summed
    over the heads in the default's pairwise order); None for input the C code does not take. IndexError
    for an entry row outside the keys."""
    q_dtype, w_dtype = dtype_code(q), dtype_code(weights)
    if q_dtype is None or w_dtype is None or q.dim() != 4 or weights.dim() != 3 or visible.dim() != 3:
        return None
    B, S, Hi, di = q.shape
    E = rows.shape[1] if rows.dim() == 2 else -1
    if (weights.shape != (B, S, Hi) or rows.shape != (B, E) or visible.shape != (B, S, E) or k < 1
            or not codes_fit(MXFP4_INDEX, di) or index_keys.dtype is not torch.uint8 or index_keys.dim() != 2
            or index_keys.shape[1] != MXFP4_INDEX.bytes_per_vector(di) or not index_keys.is_contiguous()
            or rows.dtype is not torch.int64 or visible.dtype is not torch.bool
            or not (index_keys.is_cpu and rows.is_cpu and visible.is_cpu)):
        return None
    if candidates is not None and (candidates.shape != (B, S, E) or candidates.dtype is not torch.bool):
        return None
    q_stride, w_stride = _item_stride(q), _item_stride(weights)
    if q_stride is None or w_stride is None:
        return None
    r, v = rows.contiguous(), visible.contiguous()
    c = None if candidates is None else candidates.contiguous()
    picks = torch.empty((B, S, k), dtype=torch.int64)
    out_pool = positions = None
    block = keep = rate = 1
    if pool is not None:
        block, keep, rate, positions = pool
        if positions.shape != (B, S) or block < 1 or rate < 1:
            return None
        positions = positions.to(torch.int64).contiguous()
        out_pool = torch.empty((B, S, E), dtype=torch.bool)
    if B * S == 0:
        return picks, out_pool
    status = _INDEX_SELECT(lib, q=q.data_ptr(), q_dtype=q_dtype, q_stride=q_stride, w=weights.data_ptr(),
                           w_dtype=w_dtype, w_stride=w_stride, w_scale=weight_scale, keys=index_keys.data_ptr(),
                           n=index_keys.shape[0], rows=r.data_ptr(), visible=v.data_ptr(),
                           candidates=None if c is None else c.data_ptr(),
                           pool=None if out_pool is None else out_pool.data_ptr(),
                           q_pos=None if positions is None else positions.data_ptr(), rate=rate, block=block,
                           top_blocks=keep, picks=picks.data_ptr(), B=B, S=S, Hi=Hi, di=di, E=E, k=k,
                           num_threads=threads())
    if status:
        raise IndexError(f"index_select: an entry row is outside the index keys ({index_keys.shape[0]} rows); the "
                         f"step plan's entry rows must address the bound cache")
    return picks, out_pool
