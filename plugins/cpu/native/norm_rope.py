"""rms_norm, rotary and rms_norm_rotary (norm_rope.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code, f32, new_like, threads

_RMS_NORM = Kernel("rms_norm")
_ROTARY = Kernel("rotary")

_RMS_NORM_ROTARY = Kernel("rms_norm_rotary")


def _norm_rows(x: torch.Tensor, weight: torch.Tensor | None, D: int
               ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """x as rows of D unit-stride elements (a 2-D row view keeps its stride), the contiguous weight and
    its dtype code (0 without one); None for a weight the C norm does not take."""
    w_dtype = 0 if weight is None else dtype_code(weight)
    if weight is not None and (weight.shape != (D,) or w_dtype is None):
        return None
    flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, D)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, None if weight is None else weight.contiguous(), w_dtype


def rms_norm_arguments(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> Bound | None:
    """The rows of `x` RMS-normalised (times `weight` when given): the checked call (outputs: the normalised
    rows, x's shape), not made (binding.run makes it); None: not handled."""
    dtype = dtype_code(x)
    if dtype is None or x.dim() == 0 or x.numel() == 0:
        return None
    D = x.shape[-1]
    rows = _norm_rows(x, weight, D)
    if rows is None:
        return None
    flat, w, w_dtype = rows
    out = new_like(x)
    values = dict(x=flat.data_ptr(), x_row_stride=flat.stride(0), w=None if w is None else w.data_ptr(),
                  w_dtype=w_dtype, out=out.data_ptr(), rows=flat.shape[0], D=D, eps=eps, dtype=dtype,
                  num_threads=threads())
    return Bound(_RMS_NORM, values, out, (flat, w))


def rotary(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           inverse: bool) -> torch.Tensor | None:
    dtype = dtype_code(x)
    if dtype is None or x.dim() < 2 or cos.dim() != 2 or cos.shape != sin.shape or not cos.is_cpu:
        return None
    T, half, d = x.shape[0], cos.shape[1], x.shape[-1]
    if cos.shape[0] != T or half == 0 or 2 * half > d or x.numel() == 0:
        return None  # broadcasting tables and odd shapes stay with the reference
    view = x.unsqueeze(1) if x.dim() == 2 else x.flatten(1, -2)  # [T, M, d], a view where possible
    if view.stride(-1) != 1:
        view = view.contiguous()
    c, s = f32(cos), f32(sin)
    out = new_like(x)
    _ROTARY(lib, x=view.data_ptr(), x_stride_t=view.stride(0), x_stride_m=view.stride(1), cos_t=c.data_ptr(),
            sin_t=s.data_ptr(), out=out.data_ptr(), T=T, M=view.shape[1], d=d, half=half, inverse=int(inverse),
            dtype=dtype, num_threads=threads())
    return out


def rms_norm_rotary(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor | None:
    """`rotary(rms_norm(x, weight, eps), cos, sin, inverse=False)` in one call: x `[T, ..., d]`, cos/sin
    `[T, r/2]` fp32; None for anything else."""
    dtype = dtype_code(x)
    if dtype is None or x.dim() < 2 or x.numel() == 0 or cos.dim() != 2 or cos.shape != sin.shape or not cos.is_cpu:
        return None
    T, half, d = x.shape[0], cos.shape[1], x.shape[-1]
    if cos.shape[0] != T or half == 0 or 2 * half > d:
        return None
    rows = _norm_rows(x, weight, d)
    if rows is None:
        return None
    flat, w, w_dtype = rows
    c, s = f32(cos), f32(sin)
    out = new_like(x)
    _RMS_NORM_ROTARY(lib, x=flat.data_ptr(), x_row_stride=flat.stride(0), w=None if w is None else w.data_ptr(),
                     w_dtype=w_dtype, cos_t=c.data_ptr(), sin_t=s.data_ptr(), out=out.data_ptr(), T=T,
                     M=flat.shape[0] // T, d=d, half=half, eps=eps, dtype=dtype, num_threads=threads())
    return out
