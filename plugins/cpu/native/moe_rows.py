"""moe_dispatch_rows and moe_combine_rows, the MoE's grouping by expert and weighted sum (moe_rows.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, f32, threads

_MOE_DISPATCH_ROWS = Kernel("moe_dispatch_rows")
_MOE_COMBINE_ROWS = Kernel("moe_combine_rows")


def moe_dispatch_rows(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, tokens_per_expert, source_token, source_slot) of the stable grouping by expert, or None
    (unsupported input, or an id outside [0, num_experts): the reference reports it)."""
    if (dtype_code(x) is None or x.dim() != 2 or not x.is_contiguous() or ids.dim() != 2
            or ids.shape[0] != x.shape[0] or not ids.is_cpu or ids.dtype not in (torch.int64, torch.int32)):
        return None
    T, k = ids.shape
    flat = ids.to(torch.int64).contiguous()
    counts = torch.empty(num_experts, dtype=torch.int64)
    source_token, source_slot = torch.empty(T * k, dtype=torch.int64), torch.empty(T * k, dtype=torch.int64)
    rows = torch.empty((T * k, x.shape[1]), dtype=x.dtype)
    status = _MOE_DISPATCH_ROWS(lib, ids=flat.data_ptr(), T=T, k=k, E=num_experts, x=x.data_ptr(),
                                row_bytes=x.shape[1] * x.element_size(), counts=counts.data_ptr(),
                                source_token=source_token.data_ptr(), source_slot=source_slot.data_ptr(),
                                rows=rows.data_ptr(), num_threads=threads())
    return None if status else (rows, counts, source_token, source_slot)


def moe_combine_rows(lib: ctypes.CDLL, rows: torch.Tensor, source_token: torch.Tensor, source_slot: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor | None:
    """`[T, D]` fp32: each token's k expert rows weighted by `weights [T, k]`, or None when the rows are
    not exactly one per (token, choice) (e.g. a subset of the choices) or the input is unsupported."""
    dtype = dtype_code(rows)
    if (dtype is None or rows.dim() != 2 or not rows.is_contiguous() or weights.dim() != 2
            or rows.shape[0] != weights.numel() or source_token.shape != (rows.shape[0],)
            or source_slot.shape != (rows.shape[0],) or not (source_token.is_cpu and source_slot.is_cpu)):
        return None
    T, k = weights.shape
    w = f32(weights)
    st, ss = source_token.to(torch.int64).contiguous(), source_slot.to(torch.int64).contiguous()
    out = torch.empty((T, rows.shape[1]), dtype=torch.float32)
    status = _MOE_COMBINE_ROWS(lib, rows=rows.data_ptr(), dtype=dtype, D=rows.shape[1], source_token=st.data_ptr(),
                               source_slot=ss.data_ptr(), T=T, k=k, weights=w.data_ptr(), out=out.data_ptr(),
                               num_threads=threads())
    return None if status else out
