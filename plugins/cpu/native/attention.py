"""sink_attention_decode, decode attention with a per-head sink, and sink_attention_invariant, the
same with each sequence's keys in a canonical order (attention.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, f32, float_, int_, long_, ptr, threads

_ARGUMENTS = dict(q=ptr, kv=ptr, mask=ptr, sinks=ptr, scale=float_, out=ptr, B=long_, S=long_, H=long_, L=long_,
                  d=long_, dtype=int_, num_threads=int_)
_SINK_ATTENTION_DECODE = Kernel("sink_attention_decode", **_ARGUMENTS)
_SINK_ATTENTION_INVARIANT = Kernel("sink_attention_invariant", **_ARGUMENTS)


def _call(kernel: Kernel, lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
          sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    dtype = dtype_code(q)
    if (dtype is None or q.dim() != 4 or kv.dim() != 3 or kv.dtype != q.dtype or not kv.is_cpu
            or kv.shape[0] != q.shape[0] or kv.shape[2] != q.shape[3] or mask.shape != (q.shape[0], q.shape[1], kv.shape[1])
            or mask.dtype != torch.bool or sinks.shape != (q.shape[2],)):
        return None
    B, S, H, d = q.shape
    qc, kvc, m, s = q.contiguous(), kv.contiguous(), mask.contiguous(), f32(sinks)
    out = torch.empty((B, S, H, d), dtype=q.dtype)
    kernel(lib, q=qc.data_ptr(), kv=kvc.data_ptr(), mask=m.data_ptr(), sinks=s.data_ptr(), scale=scale,
           out=out.data_ptr(), B=B, S=S, H=H, L=kv.shape[1], d=d, dtype=dtype, num_threads=threads())
    return out


def sink_attention_decode(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                          sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Sink attention of `q [B, S, H, d]` over `kv [B, L, d]` (see the interface), or None for input
    the C code does not handle."""
    return _call(_SINK_ATTENTION_DECODE, lib, q, kv, mask, sinks, scale)


def sink_attention_invariant(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                             sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`sink_attention_decode` with each sequence's keys visited in a canonical order (sorted by their
    bytes), so a query's result depends only on its query and its set of visible keys: not on their
    order in `kv`, on padding, or on the other sequences and queries of the call."""
    return _call(_SINK_ATTENTION_INVARIANT, lib, q, kv, mask, sinks, scale)
