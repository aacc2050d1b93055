"""compress_store, the compressor's ring writes at decode (compressor.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code

_COMPRESS_STORE = Kernel("compress_store")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor whose rows may be apart but whose last dim is contiguous (a column slice as is)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def compress_store(lib: ctypes.CDLL, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                   position_mod: torch.Tensor, ring_row: torch.Tensor, rows_kv: torch.Tensor,
                   rows_score: torch.Tensor) -> bool:
    """`DeepseekV4Ops.compress_store` in one pass; False (nothing written) for input it does not handle."""
    bound = compress_store_arguments(lib, kv, score, ape, position_mod, ring_row, rows_kv, rows_score)
    return bound is not None and bound.call(lib) == 0


def compress_store_arguments(lib: ctypes.CDLL, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                             position_mod: torch.Tensor, ring_row: torch.Tensor, rows_kv: torch.Tensor,
                             rows_score: torch.Tensor) -> Bound | None:
    """`compress_store`'s checked call (its status: 0 when written), not made; None: not handled."""
    dtype = dtype_code(kv)
    if dtype is None or dtype_code(score) != dtype or kv.dim() != 2 or kv.shape != score.shape:
        return None
    T, w = kv.shape
    if (ape.dtype is not torch.float32 or ape.dim() != 2 or ape.shape[1] != w or not ape.is_contiguous()
            or rows_kv.dtype is not torch.float32 or rows_score.dtype is not torch.float32
            or rows_kv.dim() != 2 or rows_kv.shape != rows_score.shape or rows_kv.shape[1] != w
            or not (rows_kv.is_contiguous() and rows_score.is_contiguous())
            or position_mod.shape != (T,) or ring_row.shape != (T,)
            or position_mod.dtype is not torch.long or ring_row.dtype is not torch.long):
        return None
    kv, score = _rows(kv), _rows(score)
    pm, rr = position_mod.contiguous(), ring_row.contiguous()
    values = dict(kv=kv.data_ptr(), kv_stride=kv.stride(0), score=score.data_ptr(), score_stride=score.stride(0),
                  dtype=dtype, ape=ape.data_ptr(), m=ape.shape[0], position_mod=pm.data_ptr(), ring_row=rr.data_ptr(),
                  T=T, w=w, rows_kv=rows_kv.data_ptr(), rows_score=rows_score.data_ptr(), R=rows_kv.shape[0])
    return Bound(_COMPRESS_STORE, values, None, (kv, score, pm, rr))
