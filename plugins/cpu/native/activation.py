"""swiglu (activation.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, threads

_SWIGLU = Kernel("swiglu")


def swiglu(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor | None:
    dtype = dtype_code(gate)
    if (dtype is None or gate.dtype != up.dtype or gate.shape != up.shape or gate.dim() != 2 or gate.numel() == 0
            or gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.stride(0) != up.stride(0) or not up.is_cpu):
        return None  # e.g. separate gate and up tensors: the reference handles any layout
    out = torch.empty(gate.shape, dtype=gate.dtype)
    _SWIGLU(lib, gate=gate.data_ptr(), up=up.data_ptr(), row_stride=gate.stride(0), out=out.data_ptr(),
            rows=gate.shape[0], I=gate.shape[1], limit=limit, dtype=dtype, num_threads=threads())
    return out
